"""The training-flow demo: its maths against diffusers' own scheduler, the cross-attention capture
(restored, output unchanged), the heatmaps, the Gradio page through gradio_client, and the page
driven in a real browser (Debian's chromium and chromium-driver, with selenium)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from sdxl_trainer.config import load_config
from sdxl_trainer.diffusion import make_noise_scheduler, training_target
from sdxl_trainer.training_flow import (
    capture_cross_attention,
    forward_at,
    load_flow_models,
    pick_samples,
    predicted_original,
)
from tests.helpers import ROOT, free_port
from tests.test_training_core import SDXL_SCHEDULER


@pytest.fixture(scope="module")
def flow(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    caches = tmp_path_factory.mktemp("flow-caches")
    config = load_config(ROOT / "configs" / "quickstart.json",
                         [f"data.image_dir={ROOT / 'data' / 'images'}",
                          f"data.latent_cache.cache_dir={json.dumps(str(caches / 'latents'))}"])
    models = load_flow_models(config)
    return models, pick_samples(models, 3)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_x0_is_the_schedulers_own_estimate_and_a_perfect_prediction_gives_x0(prediction: str) -> None:
    # diffusers' own x0, unclipped (latents are not in [-1, 1]; training never clips)
    scheduler = make_noise_scheduler({**SDXL_SCHEDULER, "clip_sample": False}, prediction, False)
    scheduler.set_timesteps(1000)
    generator = torch.Generator().manual_seed(3)
    latents, noise, output = (torch.randn(1, 4, 8, 8, generator=generator) for _ in range(3))
    for timestep in (10, 500, 990):
        t = torch.tensor([timestep])
        noisy = scheduler.add_noise(latents, noise, t)
        expected = scheduler.step(output, timestep, noisy).pred_original_sample
        torch.testing.assert_close(predicted_original(scheduler, noisy, output, timestep), expected,
                                   rtol=1e-5, atol=1e-5)
        perfect = training_target(scheduler, latents, noise, t)
        torch.testing.assert_close(predicted_original(scheduler, noisy, perfect, timestep), latents,
                                   rtol=1e-4, atol=1e-4)


def test_zero_terminal_snr_last_step_gives_finite_estimates() -> None:
    for prediction in ("epsilon", "v_prediction"):
        scheduler = make_noise_scheduler(SDXL_SCHEDULER, prediction, True)
        assert float(scheduler.alphas_cumprod[-1]) == 0.0
        x0 = predicted_original(scheduler, torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8), 999)
        assert torch.isfinite(x0).all()


def test_capture_leaves_the_output_and_the_processors_as_they_were(flow) -> None:
    from sdxl_trainer.data import collate
    from sdxl_trainer.diffusion import LossModels, conditioning

    models, samples = flow
    unet = models.pipe.unet
    before = dict(unet.attn_processors)
    batch = collate([samples[0]])
    height, width = batch["target_sizes"][0].tolist()
    latents = torch.randn(1, 4, height // 8, width // 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        kwargs = conditioning(LossModels.of(models.pipe), batch, "cpu")
        plain = unet(latents, torch.tensor([300]), **kwargs).sample
        with capture_cross_attention(unet) as records:
            captured = unet(latents, torch.tensor([300]), **kwargs).sample
    assert torch.equal(plain, captured)
    assert len(records) == sum(".attn2." in name for name in before) > 0  # attn2 layers only
    assert all(record.shape[-1] == 77 for record in records)
    assert dict(unet.attn_processors) == before


def test_heatmaps_have_the_images_aspect_and_are_normalised(flow) -> None:
    models, samples = flow
    result = forward_at(models, samples[1], 400)
    height, width = result.input_image.shape[:2]
    assert result.heatmaps.shape == (len(result.tokens), height // 8, width // 8) and height != width
    assert result.tokens[0] == "<|startoftext|>" and result.tokens[-1] == "<|endoftext|>"
    peaks = result.heatmaps.amax(dim=(1, 2))
    assert peaks[0].item() == pytest.approx(1.0) and peaks[1:].max().item() == pytest.approx(1.0)
    assert (result.heatmaps >= 0).all() and (result.heatmaps <= 1).all()
    # the same training draws at another timestep: another noised image, the same input
    other = forward_at(models, samples[1], 900)
    assert np.array_equal(other.input_image, result.input_image)
    assert not np.array_equal(other.noisy_image, result.noisy_image) and result.loss != other.loss


def test_the_offered_samples_are_trainings_with_a_validation_split(flow, tmp_path: Path) -> None:
    """The demo plans the data as training does: held-out images are not offered, and sample i is
    training's sample i (the split comes from training.seed, 42 in the quickstart)."""
    from sdxl_trainer.planning import plan_run

    config = load_config(ROOT / "configs" / "quickstart.json", [
        f"data.image_dir={json.dumps(str(ROOT / 'data' / 'images'))}", "data.validation_split=0.3",
        f"data.scan_cache_dir={json.dumps(str(tmp_path / 'scan'))}", "data.latent_cache.enabled=false"])
    plan = plan_run(config).data
    models = replace(flow[0], config=config)
    offered = [Path(sample["path"]) for sample in pick_samples(models, len(plan.samples))]
    assert plan.validation and offered == [sample.record.path for sample in plan.samples]


def test_the_page_says_whose_draws_it_shows_when_training_draws_a_random_seed(flow) -> None:
    pytest.importorskip("gradio")
    import demo_training_flow

    models, samples = flow
    texts = {}
    for seed in (42, None):
        page = demo_training_flow.build_demo(replace(models, config=models.config.model_copy(
            update={"training": models.config.training.model_copy(update={"seed": seed})})), samples)
        texts[seed] = " ".join(str(getattr(block, "value", "")) for block in page.blocks.values())
    assert "seed 0's" in texts[None] and "seed 0's" not in texts[42]


def test_heatmaps_at_an_odd_latent_side(flow) -> None:
    """A 136 px bucket gives 17 latents a side, and the UNet's stride-2 convs 9 then 5 attention
    positions a side (rounded up): the heatmaps still come at the latent size."""
    models, _ = flow
    config = models.config.model_copy(update={"data": models.config.data.model_copy(update={
        "size": 136, "bucket": models.config.data.bucket.model_copy(update={"resolutions": [(136, 136)],
                                                                         "divisible_by": 8})})})
    odd = replace(models, config=config)
    result = forward_at(odd, pick_samples(odd, 1)[0], 500)
    assert result.heatmaps.shape == (len(result.tokens), 17, 17)
    assert torch.isfinite(result.heatmaps).all() and result.heatmaps[1:].amax().item() == pytest.approx(1.0)


def test_textual_inversion_tokens_are_added_and_a_runs_vectors_loaded(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    """A textual-inversion config: the page conditions on the new token (not on pieces of the base
    vocabulary), and `--adapter` (a run's folder, which holds embedding files only) loads its vectors."""
    from sdxl_trainer.embeddings import TokenSet, save_embedding_files
    from sdxl_trainer.training_flow import caption_tokens

    config = load_config(ROOT / "configs" / "textual_inversion.json", [
        f"data.image_dir={json.dumps(str(ROOT / 'data' / 'images'))}", "data.latent_cache.enabled=false",
        f"data.scan_cache_dir={json.dumps(str(tmp_path / 'scan'))}"])
    base = load_flow_models(config, device="cpu")
    assert "<shapes>" in caption_tokens(base.pipe, pick_samples(base, 1)[0]["caption"])
    tables = {name: getattr(base.pipe, name).get_input_embeddings() for name in ("text_encoder", "text_encoder_2")}
    with torch.no_grad():
        for table in tables.values():
            table.new.normal_(generator=torch.Generator().manual_seed(1))
    save_embedding_files(TokenSet(config.textual_inversion, tables), tmp_path / "run")
    trained = load_flow_models(config, tmp_path / "run", device="cpu")
    for name, table in tables.items():
        assert torch.equal(getattr(trained.pipe, name).get_input_embeddings().new, table.new)


def test_the_page_answers_gradio_client(flow) -> None:
    pytest.importorskip("gradio")
    from gradio_client import Client

    import demo_training_flow

    models, samples = flow
    demo = demo_training_flow.build_demo(models, samples)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        labels = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/render"]["parameters"]
        choices = labels[0]["python_type"]["type"]
        assert "Literal" in choices
        first = client.predict(choices.split("'")[1], 200, None, api_name="/render")
        later = client.predict(choices.split("'")[1], 800, None, api_name="/render")
    finally:
        demo.close()
    assert all(Path(image).is_file() for image in first[:4])
    assert first[4].startswith("timestep 200: loss ") and later[4].startswith("timestep 800: loss ")
    assert Path(first[1]).read_bytes() != Path(later[1]).read_bytes()  # x_t changes with the timestep


def test_a_repeated_piece_of_the_caption_has_its_own_heatmap(flow) -> None:
    """The token dropdown chooses by position: the second 'cross' of the caption shows its own map."""
    pytest.importorskip("gradio")
    from gradio_client import Client

    import demo_training_flow

    models, samples = flow
    sample = {**samples[0], "caption": "a cross and a cross"}
    demo = demo_training_flow.build_demo(models, [sample])
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        label = f"0: {sample['caption']}"
        client.predict(label, 300, None, api_name="/render")  # the page's first render fills the choices
        first, second = (client.predict(label, 300, position, api_name="/render") for position in (2, 5))
    finally:
        demo.close()
    tokens = forward_at(models, sample, 300).tokens
    assert tokens[2] == tokens[5] == "cross"
    assert first[5]["value"] == 2 and second[5]["value"] == 5 and second[5]["choices"][5] == ["5: cross", 5]
    assert Path(first[3]).read_bytes() != Path(second[3]).read_bytes()


@pytest.mark.parametrize("samples", ["0", "-2"])
def test_a_sample_count_below_one_is_a_usage_error(samples: str, capsys: pytest.CaptureFixture[str]) -> None:
    import demo_training_flow

    with pytest.raises(SystemExit) as exited:
        demo_training_flow.main(["--config", "nothing.json", "--samples", samples])
    assert exited.value.code == 2 and "at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_real_browser_drives_the_page(flow, tmp_path: Path) -> None:
    """Headless chromium: choose a sample, move the timestep, pick a token; the images change."""
    pytest.importorskip("gradio")
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs Debian's chromium and chromium-driver (make test installs them with apt where it can)")
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    import demo_training_flow

    models, samples = flow
    demo = demo_training_flow.build_demo(models, samples)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True)
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    browser = webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")), options=options)
    wait = WebDriverWait(browser, 120)

    def image_sources() -> list[str]:
        return [element.get_attribute("src") or "" for element in browser.find_elements(By.CSS_SELECTOR, "img")]

    def loss_text() -> str:
        return browser.find_element(By.CSS_SELECTOR, "#loss textarea").get_attribute("value")

    try:
        browser.get(f"http://127.0.0.1:{port}/")
        wait.until(lambda _: loss_text().startswith("timestep 500"))
        start = image_sources()
        slider = browser.find_element(By.CSS_SELECTOR, "#timestep input[type=range]")
        # drag the handle most of the way right and let go: the page renders on release
        ActionChains(browser).click_and_hold(slider).move_by_offset(slider.size["width"] * 0.4, 0).release().perform()
        wait.until(lambda _: not loss_text().startswith("timestep 500"))
        assert int(loss_text().split()[1].rstrip(":")) > 800
        after_timestep = image_sources()
        assert after_timestep != start
        sample = browser.find_element(By.CSS_SELECTOR, "#sample input")
        sample.click()
        options_shown = wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, "ul[role=listbox] li"))
        options_shown[2].click()
        wait.until(lambda _: image_sources() != after_timestep)
        after_sample = image_sources()
        token = browser.find_element(By.CSS_SELECTOR, "#token input")
        token.click()
        tokens_shown = wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, "ul[role=listbox] li"))
        tokens_shown[2].click()
        wait.until(lambda _: image_sources() != after_sample)
        browser.save_screenshot(str(tmp_path / "page.png"))
        time.sleep(0.1)
    finally:
        browser.quit()
        demo.close()
    assert (tmp_path / "page.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def world_flow(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The demo on held-out world scenes of one known shape each: their samples and shape masks.
    Scenes whose shape or colour words are one token each (the tiny tokenizer splits "triangle"
    and "green" into pieces), so that a word has one heatmap."""
    import json

    from sdxl_trainer.world.scenes import WorldSettings, caption, render, scene_for_seed

    folder = tmp_path_factory.mktemp("world-images")
    scenes = (scene_for_seed(seed, WorldSettings(two_shape_fraction=0.0)) for seed in range(3 * 10**6, 3 * 10**6 + 200))
    chosen = [scene for scene in scenes if scene.shapes[0].kind != "triangle"
              and "green" not in (scene.shapes[0].colour, scene.background)][:WORLD_SCENES]
    masks = {}
    for index, scene in enumerate(chosen):
        image, (mask,) = render(scene, 128)
        image.save(folder / f"{index:02d}.png")
        (folder / f"{index:02d}.txt").write_text(caption(scene), encoding="utf-8")
        masks[f"{index:02d}"] = (scene, mask)
    config = load_config(ROOT / "configs" / "quickstart.json", [
        f"data.image_dir={json.dumps(str(folder))}", "data.caption_dropout_prob=0.0",
        f"data.scan_cache_dir={json.dumps(str(folder.parent / 'scan'))}",
        f"data.latent_cache.cache_dir={json.dumps(str(folder.parent / 'latents'))}"])
    models = load_flow_models(config)
    samples = pick_samples(models, WORLD_SCENES)
    return models, [(sample, *masks[Path(sample["path"]).stem]) for sample in samples]


WORLD_SCENES = 8
# Measured with the shipped weights at 128², timestep 500 (docs/tiny_model.md): the shape word's
# heat is 34 % inside shapes that cover 19 % of the image (1.77×), the background colour word's 30 %;
# x0's PSNR is 36.1 / 26.9 / 16.6 dB at timesteps 100 / 500 / 900. Each floor has a margin.
SHAPE_HEAT_OVER_AREA = 1.6
X0_PSNR_AT_LEAST = {100: 32.0, 500: 24.0}


def test_a_shape_words_attention_falls_on_the_shape(world_flow) -> None:
    """On the pretrained model, the heat of the shape's word lies inside the shape well above
    chance (the shape's share of the image), and more so than the background colour word's."""
    from sdxl_trainer.training_flow import heat_inside

    models, scenes = world_flow
    shape_heat, background_heat, areas = [], [], []
    for sample, scene, mask in scenes:
        result = forward_at(models, sample, 500)
        shape_heat.append(heat_inside(result.heatmaps[result.tokens.index(scene.shapes[0].kind)], mask))
        background_heat.append(heat_inside(result.heatmaps[result.tokens.index(scene.background)], mask))
        areas.append(float(mask.mean()))
    assert np.mean(shape_heat) >= SHAPE_HEAT_OVER_AREA * np.mean(areas), (shape_heat, areas)
    assert np.mean(shape_heat) > np.mean(background_heat), (shape_heat, background_heat)


def test_the_x0_estimate_is_close_to_the_clean_image_and_degrades_with_noise(world_flow) -> None:
    models, scenes = world_flow
    psnr = {t: np.mean([forward_at(models, sample, t).x0_psnr() for sample, _, _ in scenes]) for t in (100, 500, 900)}
    assert psnr[100] >= X0_PSNR_AT_LEAST[100] and psnr[500] >= X0_PSNR_AT_LEAST[500], psnr
    assert psnr[100] > psnr[500] > psnr[900], psnr


@pytest.mark.slow
@pytest.mark.parametrize("latent_cache", [False, True])
def test_the_demos_loss_is_the_training_steps_loss_on_a_masked_weighted_subset(tiny_sdxl_dir: Path, tmp_path: Path,
                                                                                latent_cache: bool) -> None:
    """Training's own step (`run.forward_backward`, its data loader and draws) and the demo on the
    same sample at the timestep training drew: the same loss to the bit, with the image's mask,
    its subset's loss weight and min-SNR's timestep weight all in it; with the latent cache on, from
    the latent training samples from the cached distribution (not the image encoded anew)."""
    from sdxl_trainer.config import validate_config
    from sdxl_trainer.planning import plan_run
    from sdxl_trainer.run import epoch_batches, forward_backward, start_run
    from tests.helpers import tiny_config
    from tests.test_dataset_subsets import make_folder

    make_folder(tmp_path / "masked", 2, "cut", alpha=True, size=(64, 64))
    settings = tiny_config(tmp_path, model={"train_text_encoder_1": False}, adapter={"type": "none"},
                           training={"lr_text_encoder_1": None, "snr_gamma": 5.0, "tensorboard": {"enabled": False}},
                           data={"subsets": [{"image_dir": str(tmp_path / "masked"), "alpha_mask": True,
                                              "loss_weight": 0.5}],
                                 "latent_cache": {"enabled": latent_cache, "cache_dir": str(tmp_path / "latents")},
                                 "text_cache": {"enabled": False},
                                 "bucket": {"resolutions": [[64, 64]], "divisible_by": 32, "batch_size": 1}})
    del settings["data"]["image_dir"]
    config = validate_config(settings)
    run = start_run(config, plan_run(config))
    try:
        batch = next(epoch_batches(run))
        loss = forward_backward(run, batch)
    finally:
        run.stop.restore()
        run.lock.release()
    assert "masks" in batch and 0 < float(batch["masks"].mean()) < 1 and batch["loss_weights"].tolist() == [0.5]
    (index, epoch), timestep = batch["keys"][0], run.tally.batch_timesteps[0]
    assert epoch == 0
    models = load_flow_models(config)
    result = forward_at(models, pick_samples(models, index + 1)[index], timestep)
    assert result.loss == float(loss.detach())
    assert result.sample_loss != result.loss  # the weights are in it, as in training
