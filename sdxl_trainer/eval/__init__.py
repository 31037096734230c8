"""Eval images and validation loss: when to evaluate, the prompts, the samplers (ComfyUI's KSampler
or diffusers'), rendering, and the check that an image is real."""
