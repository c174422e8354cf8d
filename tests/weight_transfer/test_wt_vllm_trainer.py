"""A trainer written for vLLM's weight-transfer API (issue 38): its own source's metadata as
plain records, ``rank_offset`` in a gloo ``init_info``, a client written to vLLM's
``VLLMWeightSyncClient``, vLLM's request wrappers; and what vLLM spells differently is refused
naming the field. The engine is `FakeEngine` (workers as threads); the same trainer against a
real engine is ``test_wt_vllm_loop.py``."""

from __future__ import annotations

import dataclasses
import functools
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NamedTuple

import pytest
import torch
from torch._C._distributed_c10d import ProcessGroupGloo, TCPStore
from wt_peer import FakeEngine, digests, run_all, source_digests

from ringserve.weight_transfer import (
    StateDictSource,
    TensorMeta,
    TrainerWeightTransferEngine,
    WeightTransferConfig,
    make_receiver,
    tensor_metas,
)
from ringserve.weight_transfer.buckets import pack, plan_buckets

SHM = WeightTransferConfig("shm", bucket_bytes=1 << 20)
GLOO = WeightTransferConfig("gloo", bucket_bytes=1 << 20)


class NamedMeta(NamedTuple):
    """The record a trainer writes from the protocol's "names, shapes, dtypes"."""

    name: str
    shape: torch.Size
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class ParamMeta:
    """vLLM's own record (``vllm.distributed.weight_transfer.base.ParamMeta``), its fields in
    its order."""

    name: str
    dtype: torch.dtype | str
    shape: tuple[int, ...]


class RecordSource:
    """A trainer's own WeightSource: `metadata()` returns whatever records it is given."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], records: Any) -> None:
        self.tensors = tensors
        self.records = records

    def metadata(self) -> Any:
        return self.records

    def __iter__(self) -> Any:
        return iter(self.tensors.items())


def _tensors() -> dict[str, torch.Tensor]:
    return {"embed.weight": torch.randn(16, 8), "norm.weight": torch.ones(8, dtype=torch.bfloat16),
            "scale": torch.tensor(2.0)}


def _named(tensors: Mapping[str, torch.Tensor]) -> list[NamedMeta]:
    return [NamedMeta(n, t.shape, t.dtype) for n, t in tensors.items()]


def test_records_of_any_kind_are_read() -> None:
    expected = [TensorMeta("a", "float32", (2, 3)), TensorMeta("b", "bfloat16", (4,)),
                TensorMeta("c", "float32", ())]
    spellings: list[list[Any]] = [
        [NamedMeta("a", torch.Size([2, 3]), torch.float32),
         NamedMeta("b", torch.Size([4]), torch.bfloat16),
         NamedMeta("c", torch.Size(), torch.float32)],
        [ParamMeta("a", "float32", (2, 3)), ParamMeta("b", "torch.bfloat16", (4,)),
         ParamMeta("c", torch.float32, ())],
        [{"name": "a", "shape": [2, 3], "dtype": "torch.float32"},
         {"name": "b", "shape": (4,), "dtype": torch.bfloat16},
         {"name": "c", "shape": [], "dtype": "float32"}],
        expected,
    ]
    for records in spellings:
        metas = tensor_metas(records)
        assert metas == expected
        assert [m.nbytes for m in metas] == [24, 8, 4]
        assert sum(len(b.slots) for b in plan_buckets(metas, 1 << 10)) == 3
    assert tensor_metas(iter(expected)) == expected  # any iterable, a generator too


def _bad(name: Any, dtype: Any, shape: Any) -> ParamMeta:
    """A record with what its type forbids, as an untyped trainer script can make one."""
    return ParamMeta(name, dtype, shape)


@pytest.mark.parametrize(("records", "needle"), [
    (None, "metadata() must return a list of records with name, shape, dtype, got NoneType"),
    ({"name": "a"}, "must return a list of records"),
    ([NamedMeta("a", torch.Size([1]), torch.float32), ("b", (1,), torch.float32)],
     "metadata()[1] (tuple) has no 'name'"),
    ([{"name": "a", "dtype": "float32"}], "metadata()[0] ('a') (dict) has no 'shape'"),
    ([_bad(7, torch.float32, (1,))], "metadata()[0].name must be a str, got int 7"),
    ([_bad("a", torch.float32, "12")], "metadata()[0] ('a').shape must be a sequence"),
    ([_bad("a", torch.float32, (2, -1))], "('a').shape (2, -1): dimension -1 is negative"),
    ([_bad("a", torch.float32, (2.0,))], "dimension 2.0 is not an int"),
    ([_bad("a", torch.float32, (True,))], "dimension True is not an int"),
    ([_bad("a", "float33", (1,))], "('a').dtype 'float33' cannot be sent; allowed: float64"),
    ([_bad("a", torch.complex64, (1,))], "('a').dtype torch.complex64 cannot be sent"),
    ([_bad("a", 5, (1,))],
     "('a').dtype must be a torch.dtype or its name such as 'bfloat16', got int 5"),
])
def test_malformed_records_are_refused_naming_the_entry_and_field(records: Any,
                                                                  needle: str) -> None:
    with pytest.raises(TypeError) as info:
        tensor_metas(records)
    assert needle in str(info.value)


def test_a_malformed_record_is_refused_before_any_engine_call() -> None:
    tensors = _tensors()
    engine = FakeEngine(SHM)
    bad = [*_named(tensors)[:2], _bad("scale", "complex", ())]
    with TrainerWeightTransferEngine(SHM, engine) as trainer:
        with pytest.raises(TypeError, match=r"metadata\(\)\[2\] \('scale'\)\.dtype 'complex'"):
            trainer.trainer_init(RecordSource(tensors, bad))
        assert engine.calls == []
        source = RecordSource(tensors, _named(tensors))
        trainer.trainer_init(source)
        source.records = [{"name": "embed.weight", "shape": [16, 8]}]  # later, a bad round
        with pytest.raises(TypeError, match=r"\[0\] \('embed.weight'\) \(dict\) has no 'dtype'"):
            trainer.send_weights()
        assert engine.calls == ["init"]  # no start_weight_update
    engine.close()


def test_named_tuple_records_and_live_parameters_over_shm() -> None:
    """The source yields its module's live parameters (requires_grad), as vLLM's
    ``ModuleSource`` does; what arrives is their bytes."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False))
    tensors = dict(module.named_parameters())
    engine = FakeEngine(SHM, num_workers=2)
    with TrainerWeightTransferEngine(SHM, engine) as trainer:
        trainer.trainer_init(RecordSource(tensors, _named(tensors)), {"rank": 0})
        assert trainer.send_weights() == "1"
    assert engine.received == [digests((n, p.detach()) for n, p in tensors.items())]
    assert engine.metadata[0] == {"names": list(tensors),
                                  "dtype_names": ["float32"] * 3,
                                  "shapes": [[16, 8], [16], [4, 16]]}
    engine.close()


def _open_port() -> int:
    """A free TCP port, as vLLM's ``get_open_port()`` finds one for its examples."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_vllm_init_info_over_gloo() -> None:
    tensors = _tensors()
    engine = FakeEngine(GLOO, num_workers=2)
    init_info = {"master_address": "127.0.0.1", "master_port": _open_port(), "rank_offset": 1,
                 "world_size": engine.get_world_size() + 1}
    with TrainerWeightTransferEngine(GLOO, engine, timeout_s=20) as trainer:
        trainer.trainer_init(RecordSource(tensors, _named(tensors)), {**init_info, "rank": 0})
        assert engine.init_infos[0] == init_info
        for round_ in range(2):
            trainer.send_weights()
            assert engine.received[round_] == source_digests(tensors)
            tensors["embed.weight"].mul_(-1)
    engine.close()


@pytest.mark.parametrize(("backend", "init_info", "needle"), [
    ("gloo", {"rank_offset": 2, "world_size": 3},
     "rank_offset 2, but a TrainerWeightTransferEngine is the group's one trainer rank"),
    ("gloo", {"rank": 1}, "rank 1, but only the sender, rank 0, runs"),
    ("shm", {"rank": 1}, "rank 1, but only the sender"),
    ("shm", {"rank_offset": 1}, "unknown field `rank_offset`; expected {}: the trainer takes none"),
    ("gloo", {"rank_offset": "1"}, "at `$.rank_offset`"),
])
def test_trainer_init_info_vllm_fields_that_mean_something_else(
        backend: str, init_info: dict[str, Any], needle: str) -> None:
    config = WeightTransferConfig(backend)  # type: ignore[arg-type]
    engine = FakeEngine(config)
    with TrainerWeightTransferEngine(config, engine) as trainer:
        with pytest.raises(ValueError) as info:
            trainer.trainer_init(StateDictSource({"w": torch.ones(2)}), init_info)
        assert needle in str(info.value)
    assert engine.calls == []


_INFO = {"master_address": "127.0.0.1", "master_port": 1}


@pytest.mark.parametrize(("init_info", "needle"), [
    ({**_INFO, "rank_offset": 0, "world_size": 2}, "`int` >= 1 - at `$.rank_offset`"),
    ({**_INFO, "rank_offset": 2, "world_size": 3},
     "world_size 3, but the trainer's 2 ranks (rank_offset) and this engine's 2 workers make 4"),
    ({**_INFO, "rank_offset": 1, "world_size": 4},
     "world_size 4, but the trainer and this engine's 2 workers make 3"),
    ({"init_info": {**_INFO, "world_size": 5}},  # vLLM's request wrapper, read through
     "world_size 5, but the trainer and this engine's 2 workers make 3"),
])
def test_receiver_rank_offset_checks(init_info: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        make_receiver(GLOO, init_info, worker_index=0, num_workers=2, timeout_s=1.0)
    assert needle in str(info.value)


def test_workers_take_their_ranks_from_rank_offset() -> None:
    """vLLM's layout with two trainer ranks: rank 0 broadcasts, rank 1 (another trainer
    process) joins each broadcast, and the engine's two workers are ranks 2 and 3."""
    timeout = timedelta(seconds=20)
    store = TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False, timeout=timeout)
    init_info = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 2,
                 "world_size": 4}
    # Each member has its own store client: one client's blocking wait would hold up another.
    client = TCPStore("127.0.0.1", store.port, 4, is_master=False, timeout=timeout)
    members = run_all([
        functools.partial(ProcessGroupGloo, store, 0, 4, timeout),
        functools.partial(ProcessGroupGloo, client, 1, 4, timeout),
        *(functools.partial(make_receiver, GLOO, init_info, worker_index=i, num_workers=2,
                            timeout_s=20.0) for i in range(2))])
    sender, other, receivers = members[0], members[1], members[2:]
    try:
        assert [r._group.rank() for r in receivers] == [2, 3]
        tensors = _tensors()
        (bucket,) = plan_buckets(StateDictSource(tensors).metadata(), 1 << 20)
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        slots = pack(buffer, bucket, iter(tensors.items()))
        update_info = {"nbytes": bucket.nbytes, "tensors": [
            {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset}
            for s in slots]}
        seen = run_all([
            lambda: sender.broadcast(buffer, 0).wait(),
            lambda: other.broadcast(torch.empty_like(buffer), 0).wait(),
            *(functools.partial(lambda r: digests(r.receive(update_info)), r)
              for r in receivers)])
        assert seen[2] == seen[3] == source_digests(tensors)
    finally:
        for receiver in receivers:
            receiver.close()


class VLLMClient:
    """A trainer's client written to vLLM's ``VLLMWeightSyncClient``: start and finish take
    no argument."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.engine.update_weights(update_info)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()


class VLLMLLMClient(VLLMClient):
    """vLLM's ``LLM`` spelling: ``start_weight_update(is_checkpoint_format=True)``."""

    flags: list[Any]

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.flags = [*getattr(self, "flags", []), is_checkpoint_format]
        self.engine.start_weight_update()


@pytest.mark.parametrize("client_class", [VLLMClient, VLLMLLMClient])
def test_a_client_written_to_vllms_protocol(client_class: type[VLLMClient]) -> None:
    tensors = _tensors()
    engine = FakeEngine(SHM)
    client = client_class(engine)
    with TrainerWeightTransferEngine(SHM, client) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        assert trainer.send_weights() == "1"
        assert trainer.send_weights("v2") == "v2"
    assert engine.received == [source_digests(tensors)] * 2
    assert engine.metadata == [None, None] and engine.versions == [None, None]
    if isinstance(client, VLLMLLMClient):
        assert client.flags == [True, True]  # never the metadata dict in the flag's place
    engine.close()


def test_receivers_refuse_vllms_update_info_and_unwrap_its_requests() -> None:
    tensors = _tensors()
    engine = FakeEngine(SHM)
    with TrainerWeightTransferEngine(SHM, engine) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        trainer.send_weights()
        receiver = engine.receivers[0]
        vllm_info = {"names": list(tensors), "dtype_names": ["float32", "bfloat16", "float32"],
                     "shapes": [[16, 8], [8], []], "packed": True}
        with pytest.raises(ValueError) as info:
            receiver.receive(vllm_info)
        assert ("update_info for the shm backend: names, dtype_names, shapes, packed are "
                "vLLM's per-tensor update_info") in str(info.value)
        assert "TrainerWeightTransferEngine sends it" in str(info.value)
        # vLLM's LLM.update_weights({"update_info": ...}): the same bucket, read again.
        wrapped = {"update_info": engine.update_infos[-1]}
        assert digests(receiver.receive(wrapped)) == source_digests(tensors)
    engine.close()


def test_llm_methods_take_vllms_is_checkpoint_format() -> None:
    """`LLM` / `AsyncLLM.start_weight_update(is_checkpoint_format=True)` is vLLM's default
    spelled out; False is refused by name before any engine call."""
    import trio

    from ringserve.engine.frontend.rl_api import AsyncRLMethods, SyncRLMethods

    calls: list[tuple[str, Any]] = []

    class Sync(SyncRLMethods):
        def _utility(self, method: str, *args: Any) -> Any:
            calls.append((method, args))

    class Async(AsyncRLMethods):
        async def call_utility(self, method: str, *args: Any) -> Any:
            calls.append((method, args))

    Sync().start_weight_update({"names": []}, is_checkpoint_format=True)
    trio.run(lambda: Async().start_weight_update(is_checkpoint_format=True))
    assert calls == [("start_weight_update", ({"names": []},)),
                     ("start_weight_update", (None,))]
    with pytest.raises(ValueError, match=r"^is_checkpoint_format: got False, allowed: true"):
        Sync().start_weight_update(is_checkpoint_format=False)
    with pytest.raises(ValueError, match=r"^is_checkpoint_format: got False"):
        trio.run(lambda: Async().start_weight_update(is_checkpoint_format=False))
    assert len(calls) == 2
