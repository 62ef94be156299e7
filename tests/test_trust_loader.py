"""What a hostile or careless user can hand the loader: saved states, arguments, broken shards.

A saved state is checked field by field before anything changes (generated states by the
thousand: only one-line DatapipeErrors, never another exception), names the cache it belongs to,
and a valid one resumes the exact uninterrupted stream. ``DeviceLoader(num_workers=0)`` reads in
the loop's thread, with the same batches as reader threads.
"""

from __future__ import annotations

import itertools
import shutil
import signal
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_fixtures import index_cache_info
from torch.utils.data import DataLoader

import datapipe
from datapipe import augment
from datapipe.dataset import ORDER_LIMIT, STATE_KEYS, STATE_VERSION
from datapipe.errors import ArgumentError, DatapipeError, StateError
from datapipe.testing import build_index_cache, index_of

B = 8
N = 101
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="session")
def index_cache(tmp_path_factory):
    return index_cache_info(tmp_path_factory)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """Another cache of the same size and configuration: other images (texture seed), same shape."""
    return build_index_cache(tmp_path_factory.mktemp("twin"), N, shard_size=7, seed=1)


def dataset(info_or_path, **kwargs) -> datapipe.StreamingDataset:
    kwargs.setdefault("batch_size", B)
    kwargs.setdefault("seed", 3)
    kwargs.setdefault("return_index", True)
    return datapipe.StreamingDataset(getattr(info_or_path, "path", info_or_path), **kwargs)


def indices_of(ds, k: int | None = None) -> list[list[int]]:
    """Global indices of the batches of one pass in the main process (at most ``k`` batches)."""
    return [b[2].tolist() for b in itertools.islice(iter(ds), k)]


def one_line_refusal(exc: BaseException) -> None:
    assert isinstance(exc, DatapipeError), f"{type(exc).__name__}: {exc}"
    text = str(exc)
    assert text and "\n" not in text and len(text) < 400, text


@pytest.fixture(scope="module")
def saved(index_cache):
    """A valid state: epoch 5, after 3 batches."""
    ds = dataset(index_cache)
    ds.set_epoch(5)
    indices_of(ds, 3)
    return ds.state_dict()


# ----------------------------------------------------------------------------- the state's contents


def test_the_state_names_the_cache_and_stays_small(index_cache, saved):
    import json

    assert tuple(saved) == STATE_KEYS and saved["version"] == STATE_VERSION == 3
    cache = datapipe.open(index_cache.path)
    assert saved["num_samples"] == N and saved["position"] == 3 * B and saved["epoch"] == 5
    assert saved["config_hash"] == cache.manifest.config_hash
    assert saved["build_id"] == cache.build_id and len(cache.build_id) == 32
    assert saved["contents"] == datapipe.dataset.cache_contents(cache) and len(saved["contents"]) == 16
    assert len(json.dumps(saved)) < 400


NAMED_BAD = {
    "negative position": {"position": -8},
    "position past the end": {"position": N + 8},
    "position far past the end": {"position": 2**70},
    "epoch 2**70": {"epoch": 2**70},
    "epoch 2**32 (aliases epoch 0)": {"epoch": 2**32},
    "negative epoch": {"epoch": -1},
    "seed 2**32 + 3 (aliases seed 3)": {"seed": 2**32 + 3},
    "negative seed": {"seed": -1},
    "bool position": {"position": True},
    "float position": {"position": 8.0},
    "string position": {"position": "8"},
    "string epoch": {"epoch": "5"},
    "float epoch": {"epoch": 5.0},
    "None epoch": {"epoch": None},
    "int shuffle": {"shuffle": 1},
    "bytes build id": {"build_id": b"x"},
    "other build": {"build_id": "0" * 32},
    "other contents": {"contents": "0" * 16},
    "bytes contents": {"contents": b"x"},
    "other config": {"config_hash": "0" * 16},
    "other size": {"num_samples": N + 1},
    "bool num_samples": {"num_samples": True},
    "other seed": {"seed": 4},
    "other shuffle": {"shuffle": False},
    "version 4": {"version": 4},
    "version as string": {"version": "3"},
    "version True": {"version": True},
    "position not on a step": {"position": 3},
}


@pytest.mark.parametrize("name", list(NAMED_BAD))
def test_named_bad_states_are_refused_and_change_nothing(index_cache, saved, name):
    ds = dataset(index_cache)
    ds.set_epoch(1)
    before = indices_of(ds)
    with pytest.raises(StateError) as excinfo:
        ds.load_state_dict({**saved, **NAMED_BAD[name]})
    one_line_refusal(excinfo.value)
    assert ds.epoch == 1 and indices_of(ds) == before  # nothing was applied


@pytest.mark.parametrize("state", [None, [], "state", 7, [("version", 2)], {}],
                         ids=["None", "list", "str", "int", "pairs", "empty"])
def test_non_states_are_refused(index_cache, state):
    with pytest.raises(StateError) as excinfo:
        dataset(index_cache).load_state_dict(state)
    one_line_refusal(excinfo.value)


def test_missing_and_extra_keys_are_refused(index_cache, saved):
    for key in STATE_KEYS[1:]:
        with pytest.raises(StateError, match=f"lacks {key}"):
            dataset(index_cache).load_state_dict({k: v for k, v in saved.items() if k != key})
    with pytest.raises(StateError, match="unknown keys 'batch_size'"):
        dataset(index_cache).load_state_dict({**saved, "batch_size": 8})
    with pytest.raises(StateError, match="unknown keys 1"):
        dataset(index_cache).load_state_dict({**saved, 1: 2})


def test_a_version_1_state_says_how_to_resume(index_cache, saved):
    v1 = {k: v for k, v in saved.items() if k != "build_id"} | {"version": 1}
    with pytest.raises(StateError, match=r"version 1.*set_epoch\(5\)") as excinfo:
        dataset(index_cache).load_state_dict(v1)
    one_line_refusal(excinfo.value)


def test_a_version_2_state_without_contents_still_resumes(index_cache, saved):
    """A state saved before states named the cache's contents resumes where the version 3 one does."""
    v2 = {k: v for k, v in saved.items() if k != "contents"} | {"version": 2}
    a, b = dataset(index_cache), dataset(index_cache)
    a.load_state_dict(v2)
    b.load_state_dict(saved)
    assert indices_of(a) == indices_of(b) and a.epoch == 5
    with pytest.raises(StateError, match="unknown keys 'contents'"):
        dataset(index_cache).load_state_dict({**saved, "version": 2})


@pytest.mark.parametrize("change", ["changed", "added", "removed", "added-v2"])
def test_a_state_of_a_cache_rebuilt_in_place_from_changed_inputs_is_refused(tmp_path, change):
    """A cache rebuilt in place keeps its build id (it says whose shards they are), so a state saved before one
    image of its source changed was accepted and resumed the saved position over other samples. The state names
    the cache's contents; a rebuild of unchanged inputs keeps them. An image added or removed was refused as
    another cache ("resume with the same cache"), without the set_epoch advice; so was a version 2 state's."""
    cache = build_index_cache(tmp_path, 30, shard_size=7)
    ds = dataset(cache)
    ds.set_epoch(2)
    indices_of(ds, 2)
    state = ds.state_dict()

    def rebuild() -> None:
        datapipe.build(tmp_path / "source", cache, size=32, shard_size=7, cluster=datapipe.Cluster(scheduler="sync"),
                       progress=False)

    rebuild()  # nothing changed: the same cache
    dataset(cache).load_state_dict(state)
    images = sorted(p for p in (tmp_path / "source").rglob("*") if p.is_file())
    if change == "changed":
        shutil.copyfile(images[1], images[0])
    elif change == "removed":
        images[0].unlink()
    else:
        shutil.copyfile(images[1], images[1].with_name("added" + images[1].suffix))
    if change.endswith("v2"):
        state = {k: v for k, v in state.items() if k != "contents"} | {"version": 2}
    rebuild()
    assert datapipe.open(cache).build_id == state["build_id"]
    counts = {"changed": "", "removed": "30 samples, now 29", "added": "30 samples, now 31"}
    with pytest.raises(StateError, match=rf"other contents .*{counts.get(change, '30 samples, now 31')}.*rebuilt in "
                                         r"place from changed inputs.*set_epoch\(2\)") as excinfo:
        dataset(cache).load_state_dict(state)
    one_line_refusal(excinfo.value)


def test_a_state_of_another_cache_of_the_same_shape_is_refused(index_cache, twin, saved):
    other = dataset(twin)
    assert len(other) == len(dataset(index_cache)) and other.cache.shape == datapipe.open(index_cache.path).shape
    assert other.state_dict()["config_hash"] == saved["config_hash"]  # same configuration, other images
    with pytest.raises(StateError, match="build_id") as excinfo:
        other.load_state_dict(saved)
    one_line_refusal(excinfo.value)
    # and the other way round
    other.set_epoch(5)
    indices_of(other, 3)
    with pytest.raises(StateError, match="build_id"):
        dataset(index_cache).load_state_dict(other.state_dict())


def test_numpy_integers_are_integers(index_cache, saved):
    ds = dataset(index_cache)
    ds.load_state_dict({**saved, "epoch": np.int64(5), "position": np.int32(3 * B), "seed": np.uint32(3)})
    assert ds.epoch == 5 and ds.start == 3 * B


def _interrupt_before_handover(how: str, ds: datapipe.StreamingDataset, at: int):
    """Make a KeyboardInterrupt land after batch ``at`` (1-based) is counted as the loop's, before the loop has it:
    raised by note_received once it counted it (a signal handler run inside it), or at the line ``yield batch``
    itself (where a handler runs when a signal arrives just before the yield, placed with a trace function)."""
    import inspect
    import sys

    from datapipe import dataset as dataset_module
    from datapipe import device as device_module

    if how == "inside the count":
        real = ds.note_received

        def note_received(iteration, batches):
            real(iteration, batches)
            if batches == at:
                raise KeyboardInterrupt("Ctrl-C")

        ds.note_received = note_received
        return None
    codes = {dataset_module.StreamingDataset._stream.__code__, device_module.DeviceLoader._batches.__code__}
    lines = {}
    for code in codes:
        source, first = inspect.getsourcelines(code)
        lines[code] = {first + i for i, text in enumerate(source) if text.strip() == "yield batch"}
    seen = [0]

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno in lines[frame.f_code]:
            seen[0] += 1
            if seen[0] == at:
                sys.settrace(None)
                raise KeyboardInterrupt("Ctrl-C")
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code in codes else None)
    return sys.settrace


@pytest.mark.parametrize("how", ["inside the count", "at the yield"])
@pytest.mark.parametrize("loader", ["DeviceLoader, 2 readers", "DeviceLoader, no reader", "DataLoader"])
def test_an_interrupt_before_a_batch_is_handed_over_leaves_the_state_at_what_the_loop_received(index_cache, how,
                                                                                                  loader):
    """A Ctrl-C (or a SIGTERM handler's sys.exit) landing after the loader counted a batch as the loop's but before
    the loop had it: the state said one batch more than the loop received, and a resume skipped that batch."""
    ds = dataset(index_cache, shuffle=True)
    ds.set_epoch(3)
    if loader == "DataLoader":
        it_of = DataLoader(ds, batch_size=None)
    else:
        it_of = datapipe.DeviceLoader(ds, device="cpu", output="uint8", num_workers=2 if "2" in loader else 0)
    received: list[int] = []
    stop = _interrupt_before_handover(how, ds, at=3)
    try:
        with pytest.raises(KeyboardInterrupt):
            for batch in it_of:
                received += batch[2].tolist()
    finally:
        if stop is not None:
            stop(None)
    assert len(received) == 2 * B
    state = ds.state_dict()
    assert state["position"] == 2 * B, state
    resumed = dataset(index_cache, shuffle=True)
    resumed.load_state_dict(state)
    rest = [i for batch in iter(resumed) for i in batch[2].tolist()]
    assert sorted(received + rest) == list(range(N))  # every sample of the epoch once, none skipped


def test_the_end_of_an_epoch_resumes_to_an_empty_remainder(index_cache, saved):
    ds = dataset(index_cache)
    ds.load_state_dict({**saved, "position": N})
    assert indices_of(ds) == []
    whole = dataset(index_cache)
    whole.set_epoch(5)
    assert indices_of(ds) == indices_of(whole)  # the next pass over the epoch is whole again


@pytest.mark.parametrize("how", ["dataset", "dataloader-2", "device-0", "device-2"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_finished_drop_last_epoch_resumes_to_no_batch_under_any_layout(index_cache, how, world_size):
    """drop_last skips the epoch's last partial step; the state after the last batch says the epoch is
    done (position N), never a position short of it that a smaller batch would read on from or a larger
    one refuse."""
    ds = dataset(index_cache, drop_last=True, rank=world_size - 1, world_size=world_size)
    if how.startswith("device"):
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=int(how[-1]), output="uint8")
        try:
            batches = len(list(loader))
            state = loader.state_dict()
        finally:
            loader.close()
    else:
        batches = len(list(DataLoader(ds, batch_size=None, num_workers=0 if how == "dataset" else 2)))
        state = ds.state_dict() if how == "dataset" else ds.state_dict(batches_consumed=batches)
    assert batches == N // (B * world_size) and state["position"] == N
    for batch_size in (1, 3, 4, 8, 10, 16):
        for drop_last in (True, False):
            fresh = dataset(index_cache, batch_size=batch_size, drop_last=drop_last, rank=0, world_size=world_size)
            fresh.load_state_dict(state)
            assert indices_of(fresh) == []
    mid = ds.state_dict(batches_consumed=batches - 1)  # one batch short of the end: a step boundary, as before
    assert mid["position"] == (batches - 1) * B * world_size


# ----------------------------------------------------------------------------- generated states

_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(np.int64),
    st.sampled_from([np.float64(8.0), np.bool_(True), torch.tensor(8), float("inf"), 10**400, "2", b"\xff"]),
)
_NEAR = st.one_of(st.integers(min_value=-3, max_value=N + 3), st.sampled_from([0, B, 2 * B, N, 2**31, 2**32 - 1,
                                                                              2**32, 2**32 + 3, 2**63, 2**64]))


@st.composite
def states(draw, saved: dict):
    """A valid state with some fields replaced (near and far values, wrong types), keys dropped or
    added, or something that is not a state at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(_ANY)
    state = dict(saved)
    for key in draw(st.lists(st.sampled_from(STATE_KEYS), max_size=4, unique=True)):
        action = draw(st.integers(0, 9))
        if action == 0:
            del state[key]
        elif action < 5:
            state[key] = draw(_NEAR)
        else:
            state[key] = draw(_ANY)
    if draw(st.integers(0, 9)) == 0:
        state[draw(st.one_of(st.text(max_size=8), st.integers()))] = draw(_ANY)
    return state


def _is_valid(state, saved: dict) -> bool:
    """The reference rule, written independently: exactly the saved state's identity, in-range ints. A version 2
    state (an earlier datapipe's) has no ``contents``, and is taken without it (docs/loader.md)."""
    def real_int(v):
        return type(v) is int or (isinstance(v, np.integer) and not isinstance(v, np.bool_))

    if not isinstance(state, dict) or not real_int(state.get("version")) or state["version"] not in (2, 3):
        return False
    identity = ("config_hash", "build_id", "contents") if state["version"] == 3 else ("config_hash", "build_id")
    if set(state) != set(STATE_KEYS) - ({"contents"} - set(identity)):
        return False
    if not all(real_int(state[k]) for k in ("version", "epoch", "position", "seed", "num_samples")):
        return False
    shuffle = state["shuffle"]
    if not isinstance(shuffle, (bool, np.bool_)) or bool(shuffle) != saved["shuffle"]:
        return False
    same = all(isinstance(state[k], str) and state[k] == saved[k] for k in identity)
    return (same and state["seed"] == saved["seed"] and state["num_samples"] == N
            and 0 <= state["epoch"] < ORDER_LIMIT and 0 <= state["position"] <= N
            and (state["position"] % B == 0 or state["position"] == N))


def test_thousands_of_generated_states_are_accepted_exactly_when_valid(index_cache, saved):
    ds = dataset(index_cache)
    accepted = []

    @settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(states(saved))
    def check(state):
        try:
            ds.load_state_dict(state)
        except DatapipeError as exc:
            one_line_refusal(exc)
            assert not _is_valid(state, saved), f"a valid state was refused: {state!r}: {exc}"
        else:
            assert _is_valid(state, saved), f"an invalid state was accepted: {state!r}"
            assert (ds.epoch, ds.start) == (int(state["epoch"]), int(state["position"]))
            accepted.append(state)

    check()
    assert accepted  # the generator reaches valid states too


def test_a_state_of_an_impossible_sample_count_is_refused_in_a_short_line(index_cache, saved):
    """A num_samples of sixty digits was written out with its thousands separators: a line of over 400 characters."""
    with pytest.raises(StateError) as caught:
        dataset(index_cache).load_state_dict({**saved, "num_samples": 10**60})
    one_line_refusal(caught.value)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(epoch=st.one_of(st.integers(0, 5), st.integers(0, ORDER_LIMIT - 1)), k=st.integers(0, -(-N // B)),
       shuffle=st.booleans(), batch=st.sampled_from([1, 4, 8, 13]))
def test_a_valid_state_resumes_the_uninterrupted_stream(index_cache, epoch, k, shuffle, batch):
    whole = dataset(index_cache, shuffle=shuffle, batch_size=batch)
    whole.set_epoch(epoch)
    stream = indices_of(whole)
    first = dataset(index_cache, shuffle=shuffle, batch_size=batch)
    first.set_epoch(epoch)
    assert indices_of(first, k) == stream[:k]
    resumed = dataset(index_cache, shuffle=shuffle, batch_size=batch)
    resumed.load_state_dict(first.state_dict())
    assert indices_of(resumed) == stream[k:]


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("epoch", [-1, 2**32, 2**70, 1.0, "1", True, None])
def test_set_epoch_takes_only_epochs_the_order_tells_apart(index_cache, epoch):
    ds = dataset(index_cache)
    with pytest.raises(ArgumentError, match="epoch") as excinfo:
        ds.set_epoch(epoch)
    one_line_refusal(excinfo.value)
    ds.set_epoch(2**32 - 1)
    ds.set_epoch(np.int64(7))
    assert ds.epoch == 7


@pytest.mark.parametrize("kwargs", [
    {"seed": -1}, {"seed": 2**32}, {"seed": 1.5}, {"seed": "0"}, {"batch_size": 0}, {"batch_size": 8.0},
    {"batch_size": True}, {"batch_size": "8"}, {"shuffle": "no"}, {"shuffle": 1}, {"drop_last": None},
    {"return_index": 0}, {"rank": 2, "world_size": 2}, {"rank": -1, "world_size": 2}, {"rank": 0.0, "world_size": 1},
])
def test_dataset_arguments_are_checked(index_cache, kwargs):
    with pytest.raises(ArgumentError) as excinfo:
        dataset(index_cache, **kwargs)
    one_line_refusal(excinfo.value)
    assert next(iter(kwargs)) in str(excinfo.value)


@pytest.mark.parametrize("kwargs", [
    {"local_cache": "/tmp/x"}, {"cache_limit": "1GB"}, {"storage_options": {}}, {"prefetch": "2GB"}, {"prefetch": 2},
    {"timeout": -1}, {"timeout": "x"}, {"timeout": 60.0},
])
def test_object_storage_arguments_are_refused_for_a_cache_read_in_place(index_cache, kwargs):
    """What only a cache in object storage uses is refused for a local one, never silently dropped."""
    with pytest.raises(ArgumentError, match="object storage") as excinfo:
        dataset(index_cache, **kwargs)
    one_line_refusal(excinfo.value)
    assert next(iter(kwargs)) in str(excinfo.value)


def test_ranks_from_a_broken_environment_are_refused(index_cache, monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ArgumentError, match="RANK") as excinfo:
        dataset(index_cache)
    one_line_refusal(excinfo.value)


def test_a_cache_that_is_no_path_is_refused():
    with pytest.raises(ArgumentError, match="cache"):
        datapipe.StreamingDataset(42)


@pytest.mark.parametrize("kwargs", [
    {"num_workers": -1}, {"num_workers": 2.0}, {"num_workers": "2"}, {"num_workers": True}, {"prefetch": -1},
    {"prefetch": None}, {"timeout": 0}, {"timeout": -1}, {"timeout": float("nan")}, {"timeout": float("inf")},
    {"timeout": "5"}, {"log_every": -1}, {"device": "tpu"}, {"device": 3}, {"device": "cuda:99"}, {"output": "int"},
    {"augment": "train"}, {"augment": augment.eval(8), "output": "uint8"},
])
def test_device_loader_arguments_are_checked(index_cache, kwargs):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ArgumentError) as excinfo:
        datapipe.DeviceLoader(dataset(index_cache), **kwargs)
    one_line_refusal(excinfo.value)


def test_batches_consumed_is_checked(index_cache):
    ds = dataset(index_cache)
    for k in (-1, 2**70, 2.0, "3", True, len(ds) + 1):
        with pytest.raises(StateError, match="batches_consumed") as excinfo:
            ds.state_dict(batches_consumed=k)
        one_line_refusal(excinfo.value)
    assert ds.state_dict(batches_consumed=len(ds))["position"] == N


def test_a_batch_larger_than_the_cache_needs_no_buffer_of_that_size(index_cache):
    loader = datapipe.DeviceLoader(dataset(index_cache, batch_size=2**40), device="cpu", num_workers=2,
                                   output="uint8")
    try:
        [(images, labels, index)] = [tuple(t.clone() for t in b) for b in loader]
    finally:
        loader.close()
    assert sorted(index.tolist()) == list(range(N)) and images.shape[0] == N


# ----------------------------------------------------------------------------- DeviceLoader state


def test_the_device_loader_refuses_what_the_dataset_refuses(index_cache, twin, saved):
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=0)
    for change in ({"position": -8}, {"epoch": 2**32}, {"version": 1}, {"build_id": "x"}):
        with pytest.raises(StateError) as excinfo:
            loader.load_state_dict({**saved, **change})
        one_line_refusal(excinfo.value)
    with pytest.raises(StateError, match="build_id"):
        datapipe.DeviceLoader(dataset(twin), device="cpu", num_workers=0).load_state_dict(saved)
    loader.load_state_dict(saved)
    rest = [b[2].tolist() for b in loader]
    whole = dataset(index_cache)
    whole.set_epoch(5)
    assert rest == indices_of(whole)[3:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_uint8_batch_of_an_iteration_a_newer_one_ended_is_never_overwritten(index_cache, workers):
    """A raw uint8 batch is the loader's host buffer. A newer iteration took every buffer back, also the one the
    older iteration's loop still held (an iterator kept, e.g. a peek with next(iter(loader)), or another thread's
    loop), and read other samples into it under the holder's feet."""
    ids = index_cache.ids
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=workers, output="uint8")
    kept = iter(loader)
    images, labels, index = next(kept)
    before = (images.clone(), labels.clone(), index.clone())
    seen = [i for batch in loader for i in batch[2].tolist()]  # a whole epoch, through every buffer of the ring
    assert sorted(seen) == list(range(index_cache.n))
    for now, then in zip((images, labels, index), before, strict=True):
        assert torch.equal(now, then)
    assert (index_of(images.numpy()) == ids[index.numpy()]).all()
    with pytest.raises(datapipe.errors.IterationSupersededError):
        next(kept)
    loader.close()


@pytest.mark.filterwarnings("ignore::datapipe.errors.RepeatedEpochWarning")  # an epoch read whole, then again
@pytest.mark.parametrize("workers", [0, 2])
def test_two_threads_iterating_one_loader_never_get_wrong_or_repeated_samples(index_cache, workers):
    """Two threads iterating one DeviceLoader at once: the buffer ring was taken back by one iteration while the
    other's step still filled or held a buffer, so batches held other samples' pixels (some another class's label)
    and iterations that ran to their end repeated and missed samples. Now each step runs whole, the newest
    iteration runs, the older raises at its next batch."""
    ids = index_cache.ids
    problems: list[str] = []
    finished: list[str] = []

    def run(loader: datapipe.DeviceLoader, start: threading.Barrier, name: str) -> None:
        start.wait()
        seen = []
        try:
            for images, _, index in loader:
                got, want = index_of(images.numpy()), ids[index.numpy()]
                if not (got == want).all():
                    problems.append(f"{name}: pixels of {got[got != want]} under {want[got != want]}")
                seen += index.tolist()
        except datapipe.errors.IterationSupersededError:
            return
        except Exception as exc:  # noqa: BLE001 - any other end is the defect
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
            return
        finished.append(name)
        if sorted(seen) != list(range(index_cache.n)):
            problems.append(f"{name}: {len(seen)} samples, {len(set(seen))} distinct")

    for trial in range(40):
        loader = datapipe.DeviceLoader(dataset(index_cache, batch_size=4, seed=trial), device="cpu",
                                       num_workers=workers, output="uint8", timeout=30)
        start = threading.Barrier(2)
        threads = [threading.Thread(target=run, args=(loader, start, f"{trial}{name}")) for name in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "an iteration hangs"
        loader.close()
    assert problems == []
    assert len(finished) >= 40  # one of the two, at least, read its epoch whole every time


@pytest.mark.parametrize("when", ["after an epoch", "in the middle of one", "while its locks are held"])
def test_a_device_loader_used_in_a_child_forked_after_it_began_reads_there(index_cache, when):
    """A DeviceLoader that had started its reader threads, used in a child made by fork (os.fork, multiprocessing's
    fork context, a launcher forking its ranks): fork copies no thread, but the loader counted itself started, so
    the child queued its jobs for readers that were not there and waited `timeout` (300 s), then blamed slow
    storage. The child now starts its own readers; the parent's loader reads on."""
    import os

    ds = dataset(index_cache, shuffle=True)
    loader = datapipe.DeviceLoader(ds, device="cpu", output="uint8", num_workers=2, timeout=60)
    running = iter(loader)
    next(running)
    if when == "after an epoch":
        for _ in running:
            pass
    held = when == "while its locks are held"
    if held:  # as if a reader thread of the parent were inside them at the fork
        loader._cond.acquire()
        loader._step.acquire()
        loader.meter._lock.acquire()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if when == "in the middle of one":  # the parent's iteration, carried over: it says so, in one line
                try:
                    next(running)
                    code = 3
                except datapipe.errors.IterationSupersededError as exc:
                    code = 0 if "began in the parent process, before this one was forked" in str(exc) else 4
                if code:
                    os._exit(code)
            loader.set_epoch(7)
            seen = [i for batch in loader for i in batch[2].tolist()]
            code = 0 if sorted(seen) == list(range(index_cache.n)) else 2
        finally:
            os._exit(code)
    if held:
        loader.meter._lock.release()
        loader._step.release()
        loader._cond.release()
    deadline = time.monotonic() + 60
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    if not done[0]:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waits for readers that are not there")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    loader.set_epoch(8)  # the parent's loader, and its readers, as they were
    assert sorted(i for batch in loader for i in batch[2].tolist()) == list(range(index_cache.n))
    loader.close()


def test_a_child_forked_while_reader_threads_hold_the_cache_locks_reads(index_cache):
    """A DataLoader worker forked (the default start method on Linux) while a reader thread of the parent held a
    cache's lock (it opens and closes shards under it, often, when a cache has more shards than the open-file
    budget): the lock stayed held in the child, where no thread would ever release it, and the worker waited for
    ever. Every lock reader threads take is made anew in a forked child."""
    import os

    from datapipe import cache as cache_module
    from datapipe import codecs, fetch, samples

    ds = dataset(index_cache, shuffle=False)
    next(iter(ds))  # opened, read once
    cache = ds.cache
    locks = [cache._lock, cache._index_lock, cache_module._ShardFiles._lock, codecs._limit_lock, samples._open_lock,
             fetch._parts_lock, fetch._RECORD_LOCK, fetch._POOL_LOCK]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in locks:
            lock.release()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: read a whole epoch through the dataset, as a DataLoader worker does
            code = 1
            try:
                seen = [i for batch in ds for i in batch[2].tolist()]
                code = 0 if sorted(seen) == list(range(index_cache.n)) else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waits for ever on a lock a thread of the parent held at the fork")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        holder.join()


# ----------------------------------------------------------------------------- num_workers=0


def _reader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("datapipe-reader")]


def _run(info, workers: int, *, k: int | None = None, state=None, seen_threads=None, **kwargs):
    ds = dataset(info, **{key: kwargs.pop(key) for key in ("batch_size", "shuffle") if key in kwargs})
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=workers, **kwargs)
    try:
        loader.set_epoch(2)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for batch in loader:
            out.append(tuple(t.clone() for t in batch))
            if seen_threads is not None:
                seen_threads.append((threading.active_count(), _reader_threads()))
            if k is not None and len(out) == k:
                break
        return out, loader.state_dict(), loader.stats()
    finally:
        loader.close()


def _same(a, b) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("kwargs", [
    {},
    {"augment": augment.train(24, color_jitter=0.4)},
    {"augment": augment.eval(20, channels_last=True)},
    {"output": "uint8"},
    {"augment": augment.convert(module=torch.nn.Dropout(0.3), dtype=torch.bfloat16)},
    {"batch_size": 13, "shuffle": False, "augment": augment.convert(normalize=False)},
], ids=["normalise", "train", "eval-channels-last", "uint8", "generic-module", "unshuffled"])
def test_num_workers_0_reads_in_the_loops_thread_with_the_same_batches(index_cache, kwargs):
    assert not _reader_threads()
    before = threading.active_count()
    seen: list = []
    inline, state0, stats0 = _run(index_cache, 0, seen_threads=seen, **dict(kwargs))
    threaded, state2, stats2 = _run(index_cache, 2, **dict(kwargs))
    assert _same(inline, threaded) and len(inline) == -(-N // kwargs.get("batch_size", B))
    assert state0 == state2 and stats0["batches"] == stats2["batches"] == len(inline)
    assert all(count <= before and names == [] for count, names in seen), seen  # no thread was started


def test_num_workers_0_state_and_resume_match_threads(index_cache):
    kwargs = {"augment": augment.train(24)}
    head, state, _ = _run(index_cache, 0, k=4, **kwargs)
    assert state["position"] == 4 * B and state["epoch"] == 2
    head2, state2, _ = _run(index_cache, 3, k=4, **kwargs)
    assert state == state2 and _same(head, head2)
    tail, _, _ = _run(index_cache, 0, state=state, **kwargs)
    whole, _, _ = _run(index_cache, 2, **kwargs)
    assert _same(head + tail, whole)


def test_num_workers_0_delivers_a_readers_exception_with_its_traceback(index_cache, monkeypatch):
    ds = dataset(index_cache)
    original = ds.cache.read_batch
    calls = []

    def failing(indices, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("injected failure in the second read")
        return original(indices, *args, **kwargs)

    monkeypatch.setattr(ds.cache, "read_batch", failing)
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=0)
    with pytest.raises(KeyError, match="second read") as excinfo:
        for _ in loader:
            pass
    assert any(entry.name == "failing" for entry in excinfo.traceback)
    assert len(calls) == 2  # nothing was read ahead of the loop


# ----------------------------------------------------------------------------- a shard breaks mid-epoch


def _break_shard(cache_dir, name: str) -> None:
    data = max((p for p in (cache_dir / "shards" / name).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)


@pytest.mark.parametrize("how", ["device-0", "device-2", "dataloader-2"])
def test_a_shard_that_breaks_after_opening_is_named(index_cache, tmp_path, how):
    copy = shutil.copytree(index_cache.path, tmp_path / "cache")
    ds = dataset(copy, shuffle=False)
    _break_shard(copy, "000005.zarr")  # after the dataset was opened (its sizes were fine then)
    kind, workers = how.split("-")
    if kind == "device":
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=int(workers))
    else:
        loader = DataLoader(ds, batch_size=None, num_workers=int(workers), multiprocessing_context="fork")
    got = 0
    with pytest.raises(DatapipeError) as excinfo:
        for batch in loader:
            got += int(batch[1].shape[0])
    assert "000005.zarr" in str(excinfo.value)
    assert "shared memory" not in str(excinfo.value)
    # torch re-raises a worker's error from a frame that holds it: a reference cycle through the traceback
    # that keeps the DataLoader's iterator. Left to the cyclic collector (during some later test), its queues
    # are finalised before it, and its shutdown then waits 5 s per worker. Cleared here, it ends at once.
    traceback.clear_frames(excinfo.tb)
    if kind == "device":
        one_line_refusal(excinfo.value)
        assert got == 32  # the batches before the broken shard (samples 35..41) arrived
        loader.close()


@pytest.mark.parametrize("copy_by", ["copy", "deepcopy", "pickle"])
def test_a_copied_dataset_keeps_its_own_state_for_its_workers(index_cache, copy_by):
    """Ray, submitit and cloudpickle ship a dataset pickled; a copy's state was an ordinary tensor, so its forked
    persistent workers never saw set_epoch (every epoch read epoch 0's order, with a warning to call it) nor
    load_state_dict (the resumed samples came twice). A copy now shares its own state with its workers, and
    leaves the original's alone."""
    import copy
    import pickle

    original = dataset(index_cache)
    ds = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda d: pickle.loads(pickle.dumps(d))}[copy_by](
        original)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append([b[2].tolist() for b in loader])
    reference = dataset(index_cache)
    for epoch, got in enumerate(epochs):
        reference.set_epoch(epoch)
        assert got == indices_of(reference)
    assert epochs[0] != epochs[1]
    reference.set_epoch(2)
    head = indices_of(reference, 3)
    ds.load_state_dict(reference.state_dict(batches_consumed=3))
    assert head + [b[2].tolist() for b in loader] == indices_of(reference)  # resumed: each sample once
    assert original.epoch == 0 and original.start == 0


def child_reads(ds) -> None:
    ds.set_epoch(0)
    for _ in ds:
        pass


def test_a_process_the_dataset_is_passed_to_leaves_the_originals_epoch_and_position(index_cache):
    """multiprocessing hands a child torch's shared tensors as they are: a child that set the epoch and read an
    epoch of its copy set the parent's epoch back and used up its resumed position (the parent then read the
    wrong epoch from its start). Only the dataset's own DataLoader workers share its state."""
    import multiprocessing

    source = dataset(index_cache)
    source.set_epoch(2)
    head = indices_of(source, 3)
    ds = dataset(index_cache)
    ds.load_state_dict(source.state_dict())
    child = multiprocessing.get_context("spawn").Process(target=child_reads, args=(ds,))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    source.set_epoch(2)
    assert ds.epoch == 2 and head + indices_of(ds) == indices_of(source)


def child_trains(ds, queue) -> None:
    """A process given the dataset starts its persistent workers before it first sets an epoch."""
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="fork")
    epochs = []
    for epoch in range(2):
        epochs.append([b[2].tolist() for b in loader])
        ds.set_epoch(epoch + 1)
    queue.put(epochs)


def test_a_process_given_the_dataset_that_starts_workers_first_shares_its_own_state_with_them(index_cache):
    """Its workers shared the original's state, and its later set_epoch a private copy they never saw: the same
    order every epoch, and the original's state_dict refused as if its own workers had read."""
    import multiprocessing

    ds = dataset(index_cache)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=child_trains, args=(ds, queue))
    child.start()
    epochs = queue.get(timeout=120)
    child.join(60)
    reference = dataset(index_cache)
    for epoch, got in enumerate(epochs):
        reference.set_epoch(epoch)
        assert got == indices_of(reference)
    assert epochs[0] != epochs[1]
    assert ds.state_dict()["epoch"] == 0  # no worker of the child's read for the original


def copy_and_move(_: int) -> None:
    """A worker_init_fn that copies its worker's dataset and moves the copy's epoch."""
    import copy

    copy.copy(torch.utils.data.get_worker_info().dataset).set_epoch(7)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_copy_made_in_a_dataloader_worker_is_a_copy(index_cache, context):
    """A worker's copy.copy kept the state the worker shares with its main process: its set_epoch(7) moved the
    main dataset's epoch, and the loop read epoch 7's order where set_epoch(2) was called."""
    ds = dataset(index_cache)
    ds.set_epoch(2)
    loader = DataLoader(ds, batch_size=None, num_workers=1, worker_init_fn=copy_and_move,
                        multiprocessing_context=context)
    got = [b[2].tolist() for b in loader]
    reference = dataset(index_cache)
    reference.set_epoch(2)
    assert ds.epoch == 2 and got == indices_of(reference)


RANK_COPIES = """
import copy, pickle, sys, tempfile
import torch.distributed as dist
import datapipe

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
for copy_by in (copy.copy, copy.deepcopy, lambda d: pickle.loads(pickle.dumps(d))):
    ds = datapipe.StreamingDataset(sys.argv[1], batch_size=8, rank=0, world_size=2)
    other = copy_by(ds)  # a second stream over the same cache, at epochs of its own
    ds.set_epoch(0)
    other.set_epoch(100)
    next(iter(ds)), next(iter(other))
print("ok")
"""


def test_a_copy_is_compared_across_ranks_as_a_dataset_of_its_own(index_cache, tmp_path):
    """A deepcopy or pickle copy kept the original's number among the datasets compared across ranks, and
    published under its keys: set at another epoch than the original, it was a RankMismatchError naming the
    same rank twice, though every rank did the same."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", RANK_COPIES, str(index_cache.path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("copy_by", ["copy", "pickle"])
def test_a_copy_taken_in_the_middle_of_an_epoch_begins_where_its_state_says(index_cache, copy_by):
    """A copy taken after the loop received 2 batches (a checkpoint by pickle or torch.save) said position 16 in
    its state_dict but read the epoch from its start: 16 samples trained on twice."""
    import copy
    import pickle

    ds = dataset(index_cache)
    ds.set_epoch(2)
    it = iter(ds)
    head = [next(it)[2].tolist() for _ in range(2)]
    dup = copy.copy(ds) if copy_by == "copy" else pickle.loads(pickle.dumps(ds))
    assert dup.state_dict()["position"] == 2 * B
    reference = dataset(index_cache)
    reference.set_epoch(2)
    assert head + indices_of(dup) == indices_of(reference)
    assert [b[2].tolist() for b in it] == indices_of(reference)[2:]  # the original goes on as it was
