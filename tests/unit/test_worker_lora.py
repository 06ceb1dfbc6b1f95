"""A worker's LoRA adapters (pdserve.worker.lora): what its --lora-modules mean to vLLM's
engine flags, to each request and to the KV tier's chunk tags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.worker.errors import InvalidRequest
from pdserve.worker.lora import Adapters, engine_flags, parse_modules
from pdserve.worker.sampling import TIER_LORA_TAG, TIER_SALT_TAG, salted_transfer_params


def adapter_dir(root: Path, name: str, rank: int) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(path)


def test_modules_become_adapters_and_vllms_flags(tmp_path: Path) -> None:
    a, b = adapter_dir(tmp_path, "a", 8), adapter_dir(tmp_path, "b", 12)
    adapters = parse_modules(f"one={a}, two={b}")
    assert [(x.name, x.path, x.rank, x.int_id) for x in adapters] == [
        ("one", a, 8, 1),
        ("two", b, 12, 2),
    ]
    # the rank rounds up to one vLLM accepts; the user's own flags win
    assert engine_flags(adapters, []) == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"
    ]  # fmt: skip
    assert engine_flags(adapters, ["--max-lora-rank=64", "--enable-lora"]) == ["--max-loras", "2"]
    assert engine_flags([], []) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [("noequals", "is not name=path"), ("a=/no/such", "no PEFT LoRA adapter"), ("=x", "name=")],
)
def test_bad_modules_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_modules(text)


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    a = adapter_dir(tmp_path, "a", 8)
    with pytest.raises(ValueError, match="given twice"):
        parse_modules(f"x={a},x={a}")


def test_a_request_names_its_adapter_or_none(tmp_path: Path) -> None:
    adapters = Adapters(parse_modules(f"one={adapter_dir(tmp_path, 'a', 8)}"))
    assert adapters.request("") is None
    lora = adapters.request("one")
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("one", 1, str(tmp_path / "a"))
    with pytest.raises(InvalidRequest, match="serves no LoRA adapter 'two'"):
        adapters.request("two")


def test_an_adapters_kv_carries_its_tag_in_the_tier(tmp_path: Path) -> None:
    one, two = parse_modules(
        f"one={adapter_dir(tmp_path, 'a', 8)},two={adapter_dir(tmp_path, 'b', 8)}"
    )
    assert one.tier_tag != two.tier_tag and one.tier_tag.isalnum()
    tagged = salted_transfer_params({"do_remote_decode": True}, None, True, one.tier_tag)
    assert tagged == {"do_remote_decode": True, TIER_LORA_TAG: one.tier_tag}
    both = salted_transfer_params(None, "s", True, one.tier_tag)
    assert both == {TIER_SALT_TAG: "s", TIER_LORA_TAG: one.tier_tag}
    assert salted_transfer_params(None, None, False, one.tier_tag) is None  # no tier


class Engine:
    """vLLM's AsyncLLM as far as run-time adapters go."""

    def __init__(self, max_rank: int | None = 16) -> None:
        from types import SimpleNamespace

        lora = None if max_rank is None else SimpleNamespace(max_lora_rank=max_rank)
        self.vllm_config = SimpleNamespace(lora_config=lora)
        self.loaded: dict[int, str] = {}

    async def add_lora(self, request: object) -> bool:
        self.loaded[request.lora_int_id] = request.lora_name  # type: ignore[attr-defined]
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loaded.pop(lora_id, None) is not None

    async def list_loras(self) -> set[int]:
        return set(self.loaded)


async def test_a_request_counts_whether_its_engine_had_to_load_the_adapter(
    tmp_path: Path,
) -> None:
    """vLLM's LoRA cache holds --max-cpu-loras adapters (list_loras); a request for one it
    does not hold loads it first: counted in the worker's lora_loads, reported resident
    (capabilities, heartbeat) once the engine lists it."""
    from types import SimpleNamespace

    from pdserve.worker.service import WorkerService

    settings = SimpleNamespace(lora_modules=f"one={adapter_dir(tmp_path, 'a', 8)}")
    engine = Engine()
    service = WorkerService(engine, settings, None)  # type: ignore[arg-type]
    assert await service.lora_request("") is None  # the base model: not counted
    assert (service.load.lora_requests, service.load.lora_loads) == (0, 0)
    request = await service.lora_request("one")
    assert request.lora_int_id == 1
    assert (service.load.lora_requests, service.load.lora_loads) == (1, 1)  # not resident
    engine.loaded[1] = "one"  # the engine loaded it to run the request
    await service.lora_request("one")
    assert (service.load.lora_requests, service.load.lora_loads) == (2, 1)
    assert await service.resident_loras() == ["one"]
    engine.loaded.clear()  # evicted for another
    assert await service.resident_loras() == [] and service.adapters.resident == frozenset()
    assert await WorkerService(Engine(None), settings, None).resident_loras() == []  # type: ignore[arg-type]


async def test_adapters_load_and_unload_at_run_time(tmp_path: Path) -> None:
    adapters = Adapters(parse_modules(f"one={adapter_dir(tmp_path, 'a', 8)}"))
    engine = Engine()
    await adapters.load(engine, "two", adapter_dir(tmp_path, "b", 16))
    assert engine.loaded == {2: "two"} and adapters.request("two").lora_int_id == 2
    with pytest.raises(InvalidRequest, match="loaded already"):
        await adapters.load(engine, "two", str(tmp_path / "b"))
    await adapters.load(engine, "two", str(tmp_path / "b"), inplace=True)  # same id again
    assert adapters.request("two").lora_int_id == 2
    with pytest.raises(InvalidRequest, match="rank 32 exceeds"):
        await adapters.load(engine, "big", adapter_dir(tmp_path, "c", 32))
    with pytest.raises(InvalidRequest, match="no PEFT LoRA adapter"):
        await adapters.load(engine, "none", str(tmp_path / "missing"))
    await adapters.unload(engine, "two")
    assert engine.loaded == {} and "two" not in adapters.by_name
    with pytest.raises(InvalidRequest, match="serves no LoRA adapter"):
        await adapters.unload(engine, "two")
    with pytest.raises(InvalidRequest, match="runs without LoRA"):
        await Adapters([]).load(Engine(None), "x", str(tmp_path / "a"))


def test_runtime_lora_leaves_room_for_adapters_loaded_later(tmp_path: Path) -> None:
    assert engine_flags([], [], runtime=True) == [
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"
    ]  # fmt: skip
    one = parse_modules(f"one={adapter_dir(tmp_path, 'a', 8)}")
    assert engine_flags(one, [], runtime=True)[-1] == "16"
