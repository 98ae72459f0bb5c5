"""Bad user input raises ValueError naming the value, and allocates nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.model_files import resolve_model
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 7}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"num_blocks": 1}, "num_blocks"),
    ],
)
def test_bad_engine_config_names_the_field(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)


def test_unknown_model_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model(str(tmp_path / "no-such-model"))


def test_engine_refuses_bad_requests_without_allocating(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, num_blocks=8)
    ok = SamplingParams(max_tokens=4)
    cases = [
        ([], ok, "prompt_token_ids"),
        ([1, -3], ok, "-3"),
        ([1, 49152], ok, "49152"),
        ([1] * 1024, ok, "max_model_len"),
        ([1] * 200, ok, "KV blocks"),
        ([1, 2], SamplingParams(stop_token_ids=(60000,)), "stop_token_ids"),
    ]
    for prompt, params, needle in cases:
        with pytest.raises(ValueError, match=needle):
            core.add_request(core.make_request("x", prompt, params))
        assert core.pool.num_free == 8 and not core.has_work()
    core.add_request(core.make_request("x", [1, 2], ok))
    with pytest.raises(ValueError, match="already in use"):
        core.make_request("x", [1, 2], ok)
