"""The files the trainer reads and writes besides its own state: adapter files (diffusers/peft,
kohya/LyCORIS), the single-file SDXL checkpoint and its key map, safetensors read and written a
tensor at a time."""
