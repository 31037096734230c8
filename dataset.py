"""The dataset: folders of images (one, or several subsets with repeats and regularization
images) with captions and optional loss masks, trained in aspect-ratio buckets with caption
augmentation (dropout and shuffle).

This file is the user's entry point to the data pipeline (`import dataset`); the code lives in
the `sdxl_trainer` package, one module per concern:

- `sdxl_trainer.scan`: finding the images, their captions and masks, skipping unusable files
- `sdxl_trainer.images`: decoding one image (EXIF orientation, transparency, modes) to RGB, masks
- `sdxl_trainer.captions`: reading captions (text files, metadata.jsonl, file names), dropout, shuffling
- `sdxl_trainer.buckets`: the bucket of each image and the batch size of each bucket
- `sdxl_trainer.crops`: scaling, cropping and mirroring an image to its bucket
- `sdxl_trainer.bucket_sampler`: the deterministic batch order, split between processes
- `sdxl_trainer.data_plan`: the epoch's composition (repeats, regularization, validation), the report
- `sdxl_trainer.data`: the training samples, collation and filling the latent cache
"""

from sdxl_trainer.bucket_sampler import BucketBatchSampler
from sdxl_trainer.buckets import (
    batch_sizes_per_bucket,
    bucket_resolutions,
    capped_size,
    merge_small_buckets,
    nearest_bucket,
    target_sizes,
)
from sdxl_trainer.captions import augment_caption, caption_reader, read_metadata
from sdxl_trainer.crops import CropPlan, plan_crop, render_view
from sdxl_trainer.data import ImageCaptionDataset, build_latent_cache, cache_views, collate, latent_key
from sdxl_trainer.data_plan import DatasetPlan, EpochSettings, Sample, plan_dataset
from sdxl_trainer.images import load_mask, load_rgb, mask_to_latent_grid, to_tensor
from sdxl_trainer.scan import IMAGE_EXTENSIONS, ImageRecord, ScanReport, scan_images

__all__ = [
    "IMAGE_EXTENSIONS",
    "BucketBatchSampler",
    "CropPlan",
    "DatasetPlan",
    "EpochSettings",
    "ImageCaptionDataset",
    "ImageRecord",
    "Sample",
    "ScanReport",
    "augment_caption",
    "batch_sizes_per_bucket",
    "bucket_resolutions",
    "build_latent_cache",
    "cache_views",
    "capped_size",
    "caption_reader",
    "collate",
    "latent_key",
    "load_mask",
    "load_rgb",
    "mask_to_latent_grid",
    "merge_small_buckets",
    "nearest_bucket",
    "plan_crop",
    "plan_dataset",
    "read_metadata",
    "render_view",
    "scan_images",
    "target_sizes",
    "to_tensor",
]
