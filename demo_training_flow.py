"""See what training sees: a Gradio page showing one training forward step.

    python demo_training_flow.py --config configs/quickstart.json [--samples 3] [--adapter .output/quickstart]

Pick a sample of the training data and a timestep: the page shows the image as training feeds it
(after bucket resize, crop and normalisation), the noised latents x_t, the UNet's estimate of the
clean image x0, the loss training would compute there, and where the cross-attention looks for a
chosen token of the caption. With `--adapter` the trained adapter is applied, so you see what the
training changed. Nothing is trained (no gradients). The page binds to 127.0.0.1 unless `--host`
says otherwise; Gradio's analytics are off. Gradio is an optional extra:
`pip install -r requirements-demo.txt`. The logic is in `sdxl_trainer/training_flow.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

EXIT_OK, EXIT_USAGE = 0, 2
COLUMNS = ("training input", "x_t (noised)", "x0 predicted", "cross-attention")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (else argparse's usage error, exit 2)."""
    value = int(text)  # not a number: argparse's own "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="demo_training_flow.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="config.json", help="training config (default: ./config.json)")
    parser.add_argument("--samples", type=positive_int, default=3,
                        help="how many images of the data to offer (default 3)")
    parser.add_argument("--adapter", default=None, help="a run's output folder or adapter file to apply "
                        "(and its textual-inversion embedding files)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    return parser.parse_args(argv)


def heatmap_overlay(image: Any, heatmap: Any) -> Any:
    """The heatmap in red over a dimmed copy of the image, upsampled to its size."""
    import numpy as np
    import torch

    size = image.shape[:2]
    scaled = torch.nn.functional.interpolate(heatmap[None, None].float(), size=size, mode="bilinear")[0, 0].numpy()
    overlay = image * 0.4
    overlay[..., 0] = np.clip(overlay[..., 0] + scaled * 0.6, 0, 1)
    return overlay


def build_demo(models, samples: list[dict]):
    """The Gradio page over loaded models and picked samples (training_flow.load_flow_models, pick_samples)."""
    import gradio as gr

    from sdxl_trainer.training_flow import forward_at, seed_note

    labels = [f"{index}: {sample['caption'][:60]}" for index, sample in enumerate(samples)]
    steps = models.scheduler.config.num_train_timesteps
    results: dict[tuple[int, int], Any] = {}

    def result(label: str, timestep: float):
        key = (labels.index(label), int(timestep))
        if key not in results:
            results[key] = forward_at(models, samples[key[0]], key[1])
        return results[key]

    def render(label: str, timestep: float, token: int | None):
        """`token` is a position in the caption (a piece may occur twice, each with its own heatmap)."""
        found = result(label, timestep)
        index = token if isinstance(token, int) and 0 <= token < len(found.tokens) else 1
        return (found.input_image, found.noisy_image, found.predicted_image,
                heatmap_overlay(found.input_image, found.heatmaps[index]),
                f"timestep {found.timestep}: loss {found.loss:.4f} (unweighted {found.sample_loss:.4f})",
                gr.Dropdown(choices=[(f"{position}: {piece}", position) for position, piece in enumerate(found.tokens)],
                            value=index))

    with gr.Blocks(title="SDXL training flow", analytics_enabled=False) as demo:
        note = seed_note(models.config)
        gr.Markdown("## One training forward step\nSample, timestep and token; nothing is trained."
                    + (f"\n\n**Note:** {note}." if note else ""))
        with gr.Row():
            sample = gr.Dropdown(labels, value=labels[0], label="sample", elem_id="sample")
            timestep = gr.Slider(0, steps - 1, value=steps // 2, step=1, label="timestep", elem_id="timestep")
            token = gr.Dropdown([], label="token", elem_id="token")
        with gr.Row():
            images = [gr.Image(label=name, height=240, elem_id=name.split()[0].replace("-", "_")) for name in COLUMNS]
        loss = gr.Textbox(label="loss at this timestep", elem_id="loss")
        outputs = [*images, loss, token]
        sample.change(render, [sample, timestep, token], outputs, api_name="render")
        timestep.release(render, [sample, timestep, token], outputs)  # on release, not every drag step
        token.input(render, [sample, timestep, token], outputs)
        demo.load(render, [sample, timestep, token], outputs)
    return demo


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("error: the demo needs gradio: pip install -r requirements-demo.txt", file=sys.stderr)
        return EXIT_USAGE
    from sdxl_trainer.config import ConfigError, load_config
    from sdxl_trainer.formats.adapter_files import AdapterFileError
    from sdxl_trainer.training_flow import load_flow_models, pick_samples

    try:
        config = load_config(args.config)
        models = load_flow_models(config, args.adapter)
        samples = pick_samples(models, args.samples)
        if not samples:
            raise ConfigError(f"data.image_dir = {config.data.image_dir!r}: no readable images found")
    except (ConfigError, AdapterFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    build_demo(models, samples).launch(server_name=args.host, server_port=args.port)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
