"""Every implementation against its declared contract (issue 50): the runners against
execution/runner.py's Runner, the attention backends against model/attention_backends.py's
AttentionBackend. A method the contract declares must be the implementation's own (not the
contract's stub inherited), take every parameter the contract names, in the same place, with a
default wherever the contract has one, and take nothing more without a default; every declared
attribute must be present, of its declared type, on a loaded runner."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

from xllm_async.execution.runner import BeamPrefilled, Prefilled, Runner
from xllm_async.model.attention_backends import (
    AttentionBackend,
    CpuKernelAttention,
    CudaFlashAttention,
    MaskedSdpaAttention,
    SdpaAttention,
)
from xllm_async.model.flash_varlen import FlashVarlen
from xllm_async.runtime.backends import choose_attention
from xllm_async.runtime.hf_runner import TransformersRunner
from xllm_async.runtime.model_runner import ModelRunner

RUNNERS = [ModelRunner, TransformersRunner]


def contract_methods(contract: type) -> list[str]:
    return sorted(name for name, value in vars(contract).items()
                  if inspect.isfunction(value) and not name.startswith("_"))


def signature_problems(declared, implemented) -> list[str]:
    """What makes `implemented` unable to take every call that `declared` allows."""
    want = list(inspect.signature(declared).parameters.values())
    have = list(inspect.signature(implemented).parameters.values())
    named = {p.name: i for i, p in enumerate(have)}
    problems = []
    for place, param in enumerate(want):
        if param.name not in named:
            problems.append(f"no parameter {param.name!r}")
            continue
        found = have[named[param.name]]
        if param.kind is param.POSITIONAL_OR_KEYWORD and named[param.name] != place:
            problems.append(f"{param.name!r} is parameter {named[param.name]}, not {place}")
        if param.default is not param.empty and found.default is found.empty:
            problems.append(f"{param.name!r} has no default")
    for extra in have:
        if extra.name not in {p.name for p in want} and extra.default is extra.empty \
                and extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
            problems.append(f"{extra.name!r} is not in the contract and has no default")
    return problems


def test_the_signature_check_sees_a_missing_a_moved_and_an_extra_parameter():
    def declared(self, a, b=0, c=None): ...

    def missing(self, a, b=0): ...

    def moved(self, b=0, a=None, c=None): ...

    def extra(self, a, b=0, c=None, d=None, e=1): ...

    def required(self, a, b=0, c=None, d=None, e=None, *, f): ...

    assert signature_problems(declared, missing) == ["no parameter 'c'"]
    assert "'a' is parameter 2, not 1" in signature_problems(declared, moved)
    assert signature_problems(declared, extra) == []
    assert signature_problems(declared, required) == ["'f' is not in the contract and has no default"]


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
def test_every_runner_names_the_contract_and_implements_each_method_with_its_signature(cls):
    assert Runner in cls.__mro__, f"{cls.__name__} does not name Runner"
    wrong = []
    for name in contract_methods(Runner):
        implemented = getattr(cls, name)
        if implemented is getattr(Runner, name):
            wrong.append(f"{name}: not implemented (the contract's stub)")
            continue
        wrong += [f"{name}: {p}" for p in signature_problems(getattr(Runner, name), implemented)]
    assert not wrong, f"{cls.__name__} against Runner:\n" + "\n".join(wrong)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> dict[type, Runner]:
    native = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    native.set_kv_cache(16 << 20, 1)
    return {ModelRunner: native, TransformersRunner: TransformersRunner(tiny_model_dir, torch.device("cpu"), "float32")}


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
def test_a_loaded_runner_has_every_declared_attribute_of_its_type(loaded, cls):
    runner = loaded[cls]
    hints = typing.get_type_hints(Runner)
    assert {"engine", "vocab_size", "caches_prefixes", "hidden_is_logits"} <= hints.keys()
    wrong = []
    for name, declared in hints.items():
        if not hasattr(runner, name):
            wrong.append(f"{name}: missing")
            continue
        kind = typing.get_origin(declared) or declared
        if not isinstance(getattr(runner, name), kind):
            wrong.append(f"{name}: {type(getattr(runner, name)).__name__}, declared {declared}")
    assert not wrong, f"{cls.__name__}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
def test_prefills_answer_with_their_result_objects_and_beam_rows_are_what_the_runner_declares(loaded, cls):
    runner = loaded[cls]
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    with torch.inference_mode():
        out = runner.prefill(prompts, capacity=8)
        scored = runner.prefill_scored(prompts, 8, None, [2, None])
        beams = runner.beam_prefill(prompts, [2, 2], 2)
    assert isinstance(out, Prefilled) and isinstance(scored, Prefilled) and isinstance(beams, BeamPrefilled)
    assert out.logits.shape == (2, runner.vocab_size) and out.cache is not None
    assert out.cached is None and out.scores is None  # (no prefix cache on either here)
    assert scored.scores[1] is None and len(scored.scores[0].logprobs) == 4
    torch.testing.assert_close(scored.logits, out.logits, atol=2e-4, rtol=2e-4)
    logits = runner.logits(beams.hidden)
    torch.testing.assert_close(logits, out.logits, atol=2e-4, rtol=2e-4)
    if runner.hidden_is_logits:  # the rows are the logits already: logits() only selects
        assert torch.equal(logits, beams.hidden)
        assert torch.equal(runner.logits(beams.hidden, columns=(3, 9)), beams.hidden[:, 3:9])
    else:  # final hidden states, which the LM head turns into logits
        assert beams.hidden.shape[1] != runner.vocab_size


# --- attention backends (model/attention_backends.py) ---


def all_backends() -> set[type]:
    found, todo = set(), [AttentionBackend]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("xllm_async.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_every_backend_implements_the_contract_with_its_signatures():
    backends = all_backends()
    assert {SdpaAttention, CpuKernelAttention, MaskedSdpaAttention, CudaFlashAttention} <= backends
    wrong = []
    for cls in sorted(backends, key=lambda c: c.__name__):
        if inspect.isabstract(cls):
            wrong.append(f"{cls.__name__}: leaves {sorted(cls.__abstractmethods__)} unimplemented")
        for name in sorted(AttentionBackend.__abstractmethods__):
            wrong += [f"{cls.__name__}.{name}: {p}"
                      for p in signature_problems(getattr(AttentionBackend, name), getattr(cls, name))]
    assert not wrong, "\n".join(wrong)


def cpu_backends(runner) -> dict[type, AttentionBackend]:
    """One of every backend, made to run on a CPU (the CUDA one with its flash kernel off: its
    prefill then serves as its base class's)."""
    shape = runner.model.shape
    flash = FlashVarlen()
    flash.fn = None
    made = {SdpaAttention: SdpaAttention(runner.dtype), MaskedSdpaAttention: MaskedSdpaAttention(runner.dtype),
            CudaFlashAttention: CudaFlashAttention(runner.dtype, flash)}
    ours = choose_attention(runner.device, runner.dtype, shape.head_dim, shape.heads // shape.kv_heads)
    if isinstance(ours, CpuKernelAttention):
        made[CpuKernelAttention] = ours
    return made


def run_every_kind_of_forward(runner) -> list[torch.Tensor]:
    """A prefill, two decode steps and a beam search's prefill and round: every question a backend answers."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]
    with torch.inference_mode():
        out = runner.prefill(prompts, capacity=16)
        found = [out.logits]
        for _ in range(2):
            found.append(runner.decode(out.cache, found[-1].argmax(-1).tolist()))
        beams = runner.beam_prefill(prompts, [2, 2, 2], 2)
        found.append(runner.logits(beams.hidden))
        round_one = runner.beam_decode(beams.state, [10, 11, 12, 13, 14, 15], [0, 0, 1, 1, 2, 2], [2, 2, 2])
        found.append(runner.logits(round_one))
    return found


def test_every_backend_answers_every_question_as_torchs_kernels_do(loaded):
    runner = loaded[ModelRunner]
    chosen = runner.attention
    made = cpu_backends(runner)
    assert all(isinstance(b.needs_cu_lengths, bool) for b in made.values())  # (declared on the contract)
    try:
        runner.attention = made[SdpaAttention]
        expected = run_every_kind_of_forward(runner)
        for cls, backend in made.items():
            runner.attention = backend
            for want, got in zip(expected, run_every_kind_of_forward(runner)):
                torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=lambda m, c=cls: f"{c.__name__}: {m}")
    finally:
        runner.attention = chosen
