"""Rollouts with transformers' ``generate``: the CPU default for tiny models (no start-up cost)
and the fallback wherever vLLM is missing.

By default the engine samples with the policy module itself, so ``update_weights`` is a no-op:
the next ``generate`` already sees the weights of the last optimizer step. With ``copy=True`` (or
when ``attach`` gets no module and loads ``model_path``) it keeps its own copy and
``update_weights`` copies the given tensors into it.

Sampling is plain ancestral sampling: the model's own ``generation_config`` (top_k, repetition
penalty, min_p, ...) is ignored; only ``SamplingConfig``'s temperature / top_p apply, as in the
vLLM engine. Rows are left-padded (position ids follow the attention mask, so a padded row sees
the same positions as an unpadded one). The KV cache is ``kv_cache.growing_kv_cache``: written in
place rather than re-concatenated at every step, with the same samples bit for bit. On CPU the
sampling loop is ``decode.sample_rows`` (``decode="lean"``, the default): ``generate``'s sampling
with one prefill per distinct prompt and finished rows out of the batch, the same samples as
``generate`` (bit for bit with one torch thread; see ``decode``); ``decode="generate"`` runs
transformers' ``generate``, which also serves every case the loop does not cover (a sharded
policy, another device, other cache layers). See ``base`` for the ``Completion`` semantics.
"""

from __future__ import annotations

import copy as copy_module
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

import torch

from aspo_lit.maths.settings import check_choice

from .base import Completion, LogprobsMode, RolloutEngine, SamplingConfig, named_tensors_of

log = logging.getLogger(__name__)

__all__ = ["HFEngine", "DECODE_MODES"]

DecodeMode = Literal["lean", "generate"]
DECODE_MODES: tuple[str, ...] = get_args(DecodeMode)


def _is_sharded(model: Any) -> bool:
    """True when the module's parameters are DTensor shards (FSDP2) in a multi-process run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def _generation_config(model: Any, model_path: Any) -> Any:
    """The checkpoint's ``generation_config.json`` when ``model_path`` has one, else the model's.

    Read from the file on every rank: a rank that built its model on the meta device
    (``from_config``) derives the model's generation config from config.json, whose EOS ids can
    differ from generation_config.json's, which rank 0's ``from_pretrained`` reads."""
    if model_path is not None:
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json: from_pretrained derived it from config.json too
            pass
    return getattr(model, "generation_config", None)


def _eos_ids(model: Any, tokenizer: Any, model_path: Any = None) -> list[int]:
    ids: list[int] = []
    generation_config = _generation_config(model, model_path)
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if src is None:
            continue
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


class _LogprobRecorder:
    """A logits processor that records the log-prob of each sampled token.

    Called once per decoding step with the scores that step samples from; the token it sampled
    is the last column of ``input_ids`` at the next call (or of the final sequences). Keeps one
    ``[B, V]`` log-softmax at a time.
    """

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.LongTensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, sequences[:, -1:]).squeeze(1))
            self.prev = None
        if not self.steps:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.steps, dim=1).cpu()


class _StopOnStrings:
    """Stopping criterion: a row is done once the decoded text of its last ``window`` response
    tokens contains a stop string. Records, per row, how many response tokens it had then."""

    def __init__(self, stops: list[str], tokenizer: Any, prompt_len: int) -> None:
        self.stops = stops
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        # each token decodes to >= 1 character except byte fragments; a margin covers those and
        # the leading-space handling of sentencepiece decoders at the window start
        self.window = max(len(s) for s in stops) + 8
        self.stop_len: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        resp = input_ids[:, self.prompt_len:]
        n = resp.shape[1]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if n == 0:
            return done
        rows = [b for b in range(input_ids.shape[0]) if b not in self.stop_len]
        if not rows:
            return done | True
        tails = resp[rows, max(0, n - self.window):].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        for b, text in zip(rows, texts):
            if any(s in text for s in self.stops):
                self.stop_len[b] = n
        for b in self.stop_len:
            done[b] = True
        return done


class HFEngine(RolloutEngine):
    """transformers ``generate`` engine.

    Args:
        max_batch_size: rows (prompt x sample) per ``generate`` call.
        copy: keep a private copy of the policy (``update_weights`` then copies tensors into it);
            by default the engine samples with the attached module itself.
        logprobs_mode: ``"processed"`` (log-prob under the distribution sampled from:
            temperature-scaled, top-p-renormalised - the same numbers vLLM's
            ``processed_logprobs`` gives) or ``"raw"`` (the unmodified model).
        dtype: dtype of a model this engine loads itself from ``model_path``.
        device: device of a model this engine loads itself (default: cuda if available).
        decode: ``"lean"`` (``decode.sample_rows`` where it applies, else ``generate``) or
            ``"generate"`` (always transformers' ``generate``).
    """

    name = "hf"

    def __init__(
        self,
        max_batch_size: int = 64,
        copy: bool = False,
        logprobs_mode: LogprobsMode = "processed",
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        decode: DecodeMode = "lean",
    ) -> None:
        super().__init__()
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        check_choice("decode", decode, DecodeMode)
        check_choice("logprobs_mode", logprobs_mode, LogprobsMode)
        self.decode = decode
        self.max_batch_size = int(max_batch_size)
        self.copy = bool(copy)
        self.logprobs_mode = logprobs_mode
        self.dtype = dtype
        self.device = device
        self.shares_policy = False
        self.eos_token_ids: list[int] = []
        self.pad_token_id: int = 0
        self.last_sync_s = 0.0

    # ------------------------------------------------------------------------------------------
    def attach(self, model: Any, tokenizer: Any, model_path: Any = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if tokenizer is None:
            if model_path is None:
                raise ValueError("HFEngine.attach needs a tokenizer or a model_path")
            tokenizer = AutoTokenizer.from_pretrained(model_path)
        if model is None:
            if model_path is None:
                raise ValueError("HFEngine.attach needs a model or a model_path")
            kwargs = {}
            if self.dtype is not None:
                kwargs["dtype"] = getattr(torch, self.dtype) if isinstance(self.dtype, str) else self.dtype
            model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            model = model.to(device)
            model.requires_grad_(False)
            self.shares_policy = False
        elif self.copy:
            model = copy_module.deepcopy(model)
            model.requires_grad_(False)
            self.shares_policy = False
        else:
            self.shares_policy = True
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = str(model_path) if model_path is not None else None
        self.eos_token_ids = _eos_ids(model, tokenizer, model_path)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        self._attached = True

    @property
    def lockstep(self) -> bool:
        """True when every rank must make the same forward passes: the engine samples with the
        policy itself while FSDP2 shards it (each forward all-gathers the weights). A caller gives
        every rank as many prompts, none empty (`RolloutController.val_share`)."""
        return self.shares_policy and getattr(self, "model", None) is not None and _is_sharded(self.model)

    # ------------------------------------------------------------------------------------------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        self._require_attached()
        if self.shares_policy:
            # The engine samples with the policy module itself: nothing to copy. Check (cheaply)
            # that the tensors are the module's own, so a mistaken call cannot pass silently.
            own = {n: p.data_ptr() for n, p in self.model.named_parameters(remove_duplicate=False)}
            own.update({n: b.data_ptr() for n, b in self.model.named_buffers(remove_duplicate=False)})
            for name, tensor in named_tensors_of(named_tensors):
                if own.get(name) != tensor.data_ptr():
                    raise ValueError(
                        f"HFEngine shares the policy module, but update_weights got {name!r} which is "
                        "not that module's tensor; attach the module the weights come from, or use "
                        "HFEngine(copy=True)"
                    )
            self.last_sync_s = 0.0
            return
        t0 = time.perf_counter()
        targets: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        updated: set[int] = set()
        with torch.no_grad():
            for name, tensor in named_tensors_of(named_tensors):
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"HFEngine.update_weights: the engine's model has no parameter {name!r}")
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"HFEngine.update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                        f"the engine's model {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                updated.add(id(target))
        stale = [n for n, p in self.model.named_parameters() if id(p) not in updated]
        if stale:
            log.warning("HFEngine.update_weights: %d parameters were not updated, e.g. %s", len(stale), stale[:3])
        self.last_sync_s = time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]] | list[str], n: int = 1,
                 sampling: SamplingConfig | None = None) -> list[list[Completion]]:
        prompt_ids, sampling = self._start_generate(prompts, n, sampling)
        rows = [ids for ids in prompt_ids for _ in range(n)]
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        rng_devices = [device] if device.type == "cuda" else []
        out: list[Completion] = []
        model.eval()
        try:
            with torch.random.fork_rng(devices=rng_devices, enabled=sampling.seed is not None):
                if sampling.seed is not None:
                    torch.manual_seed(int(sampling.seed))
                for start in range(0, len(rows), self.max_batch_size):
                    out.extend(self._generate_rows(rows[start:start + self.max_batch_size], sampling, device))
        finally:
            model.train(was_training)
        return [out[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

    def _generation_config(self, sampling: SamplingConfig):
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=sampling.temperature > 0,
            temperature=1.0,  # temperature / top_p are applied by our own processors (see below)
            top_p=1.0,
            top_k=0,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            num_return_sequences=1,
            max_new_tokens=int(sampling.max_tokens),
            min_new_tokens=0,
            eos_token_id=list(self.eos_token_ids) or None,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=False,
            output_logits=False,
        )

    def _generate_rows(self, rows: list[list[int]], sampling: SamplingConfig, device: torch.device) -> list[Completion]:
        from transformers.cache_utils import DynamicCache
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        from .decode import lean_decoding_applies, rows_are_stable, sample_rows
        from .kv_cache import growing_kv_cache

        B = len(rows)
        P = max(len(r) for r in rows)
        input_ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, P), dtype=torch.long)
        for b, r in enumerate(rows):
            input_ids[b, P - len(r):] = torch.tensor(r, dtype=torch.long)
            attention_mask[b, P - len(r):] = 1
        input_ids = input_ids.to(device)
        attention_mask = attention_mask.to(device)

        # Temperature / top-p as explicit processors, so the log-prob recorder can sit after them
        # ("processed") or before them ("raw"); generate() itself adds no warper.
        processors: list[Any] = []
        if sampling.temperature > 0:
            if sampling.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(float(sampling.temperature)))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=float(sampling.top_p)))
        recorder = _LogprobRecorder() if sampling.logprobs else None
        if recorder is not None:
            if self.logprobs_mode == "raw":
                processors.insert(0, recorder)
            else:
                processors.append(recorder)
        stopper = _StopOnStrings(sampling.stop, self.tokenizer, P) if sampling.stop else None

        model = self.model
        cache = growing_kv_cache(model, P + int(sampling.max_tokens))
        # An FSDP-sharded policy all-gathers in every forward: ranks must keep stepping together
        # until all of them are done (as with ZeRO-3); generate() does that (synced_gpus).
        sharded = _is_sharded(model)
        lean_cache = cache if cache is not None else DynamicCache(config=model.config)
        if self.decode == "lean" and lean_decoding_applies(model, lean_cache, sharded):
            greedy = not sampling.temperature > 0
            result = sample_rows(
                model, input_ids, attention_mask, lean_cache, max_new_tokens=int(sampling.max_tokens),
                eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                warpers=[p for p in processors if p is not recorder], greedy=greedy,
                logprobs=self.logprobs_mode if sampling.logprobs else None, stop=stopper,
                full_height=not rows_are_stable(model))
            responses = result.tokens.tolist()
            logprobs = result.logprobs.cpu() if result.logprobs is not None else None
        else:
            responses, logprobs = self._generate_with_transformers(model, input_ids, attention_mask, cache, sampling,
                                                                   processors, recorder, stopper, sharded, P)

        eos = set(self.eos_token_ids)
        completions = []
        for b, toks in enumerate(responses):
            end, reason = len(toks), "length"
            for k, t in enumerate(toks):
                if t in eos:
                    end, reason = k + 1, "stop"
                    break
            if stopper is not None and b in stopper.stop_len and stopper.stop_len[b] < end:
                end, reason = stopper.stop_len[b], "stop"
            if reason == "length" and end < sampling.max_tokens:  # pragma: no cover - defensive
                reason = "stop"
            toks = toks[:end]
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            if sampling.stop:
                cuts = [i for i in (text.find(s) for s in sampling.stop) if i >= 0]
                if cuts:
                    text = text[:min(cuts)]
            completions.append(
                Completion(
                    token_ids=toks,
                    text=text,
                    finish_reason=reason,
                    logprobs=logprobs[b, :end].tolist() if logprobs is not None else None,
                )
            )
        return completions

    def _generate_with_transformers(self, model, input_ids, attention_mask, cache, sampling: SamplingConfig,
                                    processors, recorder, stopper, sharded: bool, prompt_len: int):
        """Response token lists and log-probs ``[B, L]`` (or None) from transformers' ``generate``."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        saved_gen_config = getattr(model, "generation_config", None)
        # generate() fills unset fields from model.generation_config (top_k, min_p, penalties, ...
        # of the checkpoint): swap in a neutral one for the call.
        model.generation_config = GenerationConfig()
        try:
            result = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                generation_config=self._generation_config(sampling),
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([stopper]) if stopper is not None else None,
                synced_gpus=sharded,
            )
        finally:
            model.generation_config = saved_gen_config
        sequences = result.sequences if hasattr(result, "sequences") else result
        logprobs = recorder.finish(sequences) if recorder is not None else None
        return sequences[:, prompt_len:].tolist(), logprobs

    def close(self) -> None:
        if not self.shares_policy:
            self.model = None
        self._attached = False
