"""``--optimizer fp16_adam``: AdamW on torch's fused kernel, registered in fairseq.

Same flags and formats as fairseq's ``adam`` (``--adam-betas '(0.9, 0.98)'
--adam-eps --weight-decay``) plus ``--no-bias-correction``,
``--no-decay-params`` and ``--adam-backend``. The update is exactly
``torch.optim.AdamW``'s. Under ``--fp16``/``--bf16`` the plugin's
mixed-precision wrapper builds it over fp32 master weights and hands it the
loss scale, so unscaling and the overflow skip happen inside the fused kernel.
"""


import ast
from dataclasses import dataclass, field
from typing import Any, List, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf

from ..core.adam import ADAM_BACKENDS, build_adam, load_state_keeping_backend

__all__ = ["FP16AdamConfig", "FP16Adam", "parse_betas"]


def parse_betas(value: Any) -> Tuple[float, float]:
    """Parse ``--adam-betas`` ('(0.9, 0.98)' or a sequence) into two floats.

    Raises:
        ValueError: naming the flag, for anything but two numbers in [0, 1).
    """
    raw = value
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            value = None
    try:
        b1, b2 = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"--adam-betas must be two numbers like '(0.9, 0.98)', got {raw!r}") from None
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"--adam-betas must each be in [0, 1), got {raw!r}")
    return b1, b2


@dataclass
class FP16AdamConfig(FairseqDataclass):
    adam_betas: Any = field(default="(0.9, 0.999)", metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay (AdamW)"})
    no_bias_correction: bool = field(
        default=False, metadata={"help": "disable Adam's bias correction (as apex FusedAdam)"}
    )
    no_decay_params: str = field(
        default="bias,layer_norm,layernorm_embedding",
        metadata={
            "help": "comma-separated name patterns: parameters whose name contains one "
            "get no weight decay"
        },
    )
    adam_backend: ChoiceEnum(list(ADAM_BACKENDS)) = field(  # type: ignore[valid-type]
        default="auto",
        metadata={
            "help": "auto: torch's fused AdamW where the device has it, foreach otherwise; "
            "apex: apex FusedAdam (only if apex is installed)"
        },
    )
    lr: List[float] = II("optimization.lr")


@register_optimizer("fp16_adam", dataclass=FP16AdamConfig)
class FP16Adam(FairseqOptimizer):
    """AdamW (decoupled weight decay) for fp32 master weights or an fp32 model."""

    def __init__(self, cfg: FP16AdamConfig, params):
        super().__init__(cfg)
        params = list(params)
        if params and isinstance(params[0], dict):
            raise ValueError("fp16_adam builds its own parameter groups; pass parameters")
        self._optimizer = build_adam(
            params,
            lr=self.optimizer_config["lr"],
            betas=self.optimizer_config["betas"],
            eps=self.optimizer_config["eps"],
            weight_decay=self.optimizer_config["weight_decay"],
            no_decay_params=cfg.no_decay_params,
            bias_correction=not cfg.no_bias_correction,
            backend=str(cfg.adam_backend),
        )

    @property
    def optimizer_config(self):
        """Values that override those stored in checkpoints (fairseq protocol)."""
        lr = self.cfg.lr[0] if isinstance(self.cfg.lr, (list, tuple)) or OmegaConf.is_config(self.cfg.lr) else self.cfg.lr
        return {
            "lr": float(lr),
            "betas": parse_betas(self.cfg.adam_betas),
            "eps": float(self.cfg.adam_eps),
            "weight_decay": float(self.cfg.weight_decay),
        }

    @property
    def supports_flat_params(self):
        return True

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        """fairseq's protocol, keeping this run's Adam backend (``--adam-backend``) over the
        checkpoint's."""
        load_state_keeping_backend(self.optimizer, state_dict)
        if optimizer_overrides:
            for group in self.param_groups:
                group.update(optimizer_overrides)
