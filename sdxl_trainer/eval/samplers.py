"""Eval samplers by the names users know from A1111, ComfyUI and k-diffusion, mapped onto diffusers
schedulers (the mapping of the diffusers docs' "A1111/k-diffusion → diffusers" table).

`eval.scheduler` is either a sigma schedule (`normal`, `karras`, `exponential`, `beta`) applied
to the sampler, or the name of a diffusers scheduler class, used with the model's scheduler config
as it is (`eval.sampler_name` then does not apply).

Every combination is checked at config time against the installed diffusers: what a scheduler
accepts is read from its constructor, so an impossible or uninstallable choice is an error that
lists the valid ones, never a silently different sampler.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, closest

if TYPE_CHECKING:
    from diffusers import SchedulerMixin

    from ..config import EvalConfig

# sampler name -> (diffusers scheduler class, the settings that make it that sampler). The settings
# are explicit even where they equal the class default: the base model's scheduler config is the
# starting point and may carry other values (e.g. an SDE algorithm_type, or clip_sample=True).
SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "euler_ancestral": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "dpm_2": ("KDPM2DiscreteScheduler", {}),
    "dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpm_2_ancestral": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpmpp_2m": (
        "DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_type": "midpoint", "solver_order": 2}
    ),
    "dpmpp_2m_sde": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "sde-dpmsolver++", "solver_type": "midpoint", "solver_order": 2},
    ),
    "dpmpp_2m_sde_heun": (
        "DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_type": "heun", "solver_order": 2}
    ),
    # k-diffusion's dpmpp_sde is DPM-Solver++(2S) with SDE noise. As in the diffusers docs' table, its
    # diffusers counterpart is the single-step solver (here in its SDE variant, noise from the
    # pipeline's generator). DPMSolverSDEScheduler ports it more literally but needs torchsde and seeds
    # its noise from the global RNG; name it in eval.scheduler to use it.
    "dpmpp_sde": (
        "DPMSolverSinglestepScheduler",
        {"algorithm_type": "sde-dpmsolver++", "solver_type": "midpoint", "solver_order": 2},
    ),
    # Latent diffusion never clips its x0 prediction; SD/SDXL scheduler configs say so too.
    "ddim": ("DDIMScheduler", {"clip_sample": False, "set_alpha_to_one": False}),
    "ddpm": ("DDPMScheduler", {"clip_sample": False}),
    "unipc": ("UniPCMultistepScheduler", {"solver_type": "bh2"}),
    "deis": ("DEISMultistepScheduler", {"algorithm_type": "deis", "solver_type": "logrho"}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True, "set_alpha_to_one": False}),
}

# sigma schedule -> the scheduler flags that select it; "normal" is the scheduler's own spacing.
SIGMA_SCHEDULES: dict[str, dict[str, bool]] = {
    "normal": {},
    "karras": {"use_karras_sigmas": True},
    "exponential": {"use_exponential_sigmas": True},
    "beta": {"use_beta_sigmas": True},
}
_SIGMA_FLAGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def scheduler_class_names() -> list[str]:
    """The diffusers scheduler classes that SDXL pipelines accept (valid `eval.scheduler` class names)."""
    from diffusers.schedulers.scheduling_utils import KarrasDiffusionSchedulers

    return [member.name for member in KarrasDiffusionSchedulers]


def check_eval_sampler(eval_config: EvalConfig, base_scheduler_config: dict[str, Any] | None = None) -> None:
    """Raise a ConfigError when the `eval` block's sampler settings cannot run on its backend (and,
    given the model's scheduler config, when they cannot sample its noise schedule)."""
    from .comfyui_sampling import check_comfyui_sampler, eval_backend

    if eval_backend(eval_config) == "kdiffusion":
        check_comfyui_sampler(eval_config.sampler_name, eval_config.scheduler, eval_config.num_inference_steps)
    elif base_scheduler_config is None:
        check_sampler(eval_config.sampler_name, eval_config.scheduler)
    else:
        make_eval_scheduler(base_scheduler_config, eval_config.sampler_name, eval_config.scheduler)


def check_sampler(sampler_name: str, schedule: str) -> None:
    """Raise a ConfigError when a diffusers-backend choice cannot run with what is installed."""
    _resolve(sampler_name, schedule)


def make_eval_scheduler(base_scheduler_config: dict[str, Any], sampler_name: str, schedule: str) -> SchedulerMixin:
    """A new scheduler for sampling: the base model's config (betas, prediction type, timestep
    spacing) with the sampler's and sigma schedule's settings on top."""
    scheduler_class, overrides = _resolve(sampler_name, schedule)
    if base_scheduler_config.get("rescale_betas_zero_snr") and not _has_zero_snr(scheduler_class):
        raise ConfigError(_zero_snr_refusal(scheduler_class, sampler_name, schedule))
    return scheduler_class.from_config(base_scheduler_config, **overrides)


def _has_zero_snr(scheduler_class: type) -> bool:
    """Whether the scheduler can rescale its betas to zero terminal SNR (others would silently
    sample the model's original schedule)."""
    return "rescale_betas_zero_snr" in inspect.signature(scheduler_class.__init__).parameters


def _zero_snr_refusal(scheduler_class: type, sampler_name: str, schedule: str) -> str:
    import diffusers

    from .kdiffusion_samplers import SAMPLERS as KDIFFUSION_SAMPLERS

    where = f'eval.sampler_name = "{sampler_name}"' if schedule in SIGMA_SCHEDULES else f'eval.scheduler = "{schedule}"'
    able = [name for name, (cls, _) in SAMPLERS.items() if _has_zero_snr(getattr(diffusers, cls))]
    return (f"{where}: {scheduler_class.__name__} cannot sample the zero-terminal-SNR schedule this model trains "
            f'on (it has no rescale_betas_zero_snr); use eval.backend "kdiffusion" (or "auto" with a ComfyUI '
            f"schedule) with one of {', '.join(KDIFFUSION_SAMPLERS)}, or a diffusers sampler that can: "
            f"{', '.join(able)}")


def _resolve(sampler_name: str, schedule: str) -> tuple[type, dict[str, Any]]:
    """The scheduler class and config overrides for a sampler and schedule, or a ConfigError."""
    if schedule in SIGMA_SCHEDULES:
        if sampler_name in ("dpmpp_2s_ancestral", "dpmpp_3m_sde"):
            raise ConfigError(f'eval.sampler_name = "{sampler_name}" has no diffusers scheduler: use it with '
                              'eval.backend = "kdiffusion" (or "auto")')
        if sampler_name not in SAMPLERS:
            raise ConfigError(
                f'eval.sampler_name = "{sampler_name}": unknown sampler{_did_you_mean(sampler_name, SAMPLERS)}; '
                f"valid: {', '.join(SAMPLERS)}"
            )
        class_name, overrides = SAMPLERS[sampler_name]
        scheduler_class = _scheduler_class(class_name, f'eval.sampler_name = "{sampler_name}"')
        return scheduler_class, {**overrides, **_schedule_flags(scheduler_class, sampler_name, schedule)}
    if schedule in scheduler_class_names():
        return _scheduler_class(schedule, f'eval.scheduler = "{schedule}"'), {}
    choices = [*SIGMA_SCHEDULES, *scheduler_class_names()]
    raise ConfigError(
        f'eval.scheduler = "{schedule}": unknown{_did_you_mean(schedule, choices)}; use a sigma schedule '
        f"({', '.join(SIGMA_SCHEDULES)}) or a diffusers scheduler class ({', '.join(scheduler_class_names())})"
    )


def _scheduler_class(class_name: str, where: str) -> type:
    """The diffusers class; diffusers stands in a placeholder when an optional package is missing."""
    import diffusers
    from diffusers.utils import DummyObject

    scheduler_class = getattr(diffusers, class_name)
    if isinstance(scheduler_class, DummyObject):
        missing = [name for name in scheduler_class._backends if name != "torch"]
        raise ConfigError(
            f"{where} needs {class_name}, which needs the optional package {', '.join(missing)}: "
            f"pip install {' '.join(missing)}"
        )
    return scheduler_class


def _schedule_flags(scheduler_class: type, sampler_name: str, schedule: str) -> dict[str, bool]:
    """All three sigma flags (so the base config's choice cannot leak in), or none where the
    scheduler has no sigma schedules and `normal` is asked for."""
    if not _has_sigma_schedules(scheduler_class):
        if schedule == "normal":
            return {}
        import diffusers

        able = [name for name, (cls, _) in SAMPLERS.items() if _has_sigma_schedules(getattr(diffusers, cls))]
        raise ConfigError(
            f'eval.scheduler = "{schedule}" cannot be used with eval.sampler_name = "{sampler_name}": '
            f"{scheduler_class.__name__} has only its normal sigma schedule; samplers with {schedule} sigmas: "
            f"{', '.join(able)}"
        )
    if schedule == "beta":
        from diffusers.utils import is_scipy_available

        if not is_scipy_available():
            raise ConfigError('eval.scheduler = "beta" needs the optional package scipy: pip install scipy')
    return {flag: False for flag in _SIGMA_FLAGS} | SIGMA_SCHEDULES[schedule]


def _has_sigma_schedules(scheduler_class: type) -> bool:
    """Read from the installed constructor (a class whose package is missing has none to read)."""
    accepted = inspect.signature(scheduler_class.__init__).parameters
    return all(flag in accepted for flag in _SIGMA_FLAGS)


def _did_you_mean(name: str, choices) -> str:
    match = closest(name, choices)
    return f' (did you mean "{match}"?)' if match else ""
