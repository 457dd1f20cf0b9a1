"""The frozen reference policy of the KL term, held outside the module's checkpoint.

The paper's eq. 1 penalises ``beta * D_KL(π_θ || π_ref)``, π_ref the base model, frozen for the
whole run. Its weights are the base checkpoint's (``model.model_name_or_path``), so a checkpoint
need not carry them; for Qwen3-30B-A3B (its bf16 copy, docs/gpu.md) they were 61 GB of every save.

`ReferenceHolder` keeps the reference out of the module tree: ``state_dict()`` holds the policy's
tensors only, so every checkpoint Lightning writes leaves the reference out (a ``torch.save``
file, FSDP2's sharded folder and its full file alike, each built from that state dict), and a
strict ``load_state_dict`` expects only the policy's. `ASPOModule.configure_model` builds the
reference from the base checkpoint, and Lightning restores a checkpoint only after
``configure_model``, so a resumed fit gets the same reference as a fresh one. The reference still
follows the module's ``.to()`` / ``.cpu()`` / dtype casts (`ReferenceHolder._apply`), as it did as
a submodule.

Checkpoints written before held the reference under ``ref_policy.*`` (the base weights, frozen):
`drop_reference_weights` drops those keys on load, and the rebuilt reference is used instead.
"""

from __future__ import annotations

from typing import Any

import torch

#: the state-dict prefix of the reference in checkpoints written while it was a submodule
OLD_REFERENCE_PREFIX = "ref_policy."


class ReferenceHolder(torch.nn.Module):
    """Mixin: `ref_policy`, a frozen module that is not a submodule (left out of ``state_dict()``,
    ``parameters()`` and a strict ``load_state_dict``), yet moved and cast with its holder."""

    _reference: tuple[torch.nn.Module, ...] = ()  # a tuple: nn.Module does not register what it holds

    @property
    def ref_policy(self) -> torch.nn.Module | None:
        return self._reference[0] if self._reference else None

    def hold_reference(self, model: torch.nn.Module | None) -> None:
        self._reference = () if model is None else (model,)

    def _apply(self, fn, recurse=True):
        # every .to() / .cpu() / .cuda() / .half() ends here (Lightning's device moves, the precision
        # plugin's cast, the teardown to CPU); torchmetrics' Metric moves its states the same way
        super()._apply(fn, recurse)
        if recurse and self.ref_policy is not None:
            self.ref_policy._apply(fn, recurse)
        return self


def drop_reference_weights(checkpoint: dict[str, Any]) -> list[str]:
    """Remove the ``ref_policy.*`` entries of an older checkpoint's ``state_dict`` (in place); returns
    their keys. A checkpoint without them, or without a ``state_dict`` (FSDP2's loader has taken
    it out already, reading only the module's own keys), is left as it is."""
    state = checkpoint.get("state_dict") or {}
    dropped = [key for key in state if key.startswith(OLD_REFERENCE_PREFIX)]
    for key in dropped:
        del state[key]
    return dropped
