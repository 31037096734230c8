"""The world of shapes the built-in tiny SDXL was pretrained on, and the judge that reads its images."""
