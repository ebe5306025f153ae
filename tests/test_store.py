"""Client stores: versions by round, atomic files, pruning to the rounds a checkpoint refers to."""
import pytest
import torch

from fedsilo.client.store import (ClientState, DiskStore, MemoryStore, optimizer_from_slot,
                                  optimizer_to_slot)


def state(v: float, steps: int = 0) -> ClientState:
    return ClientState({"own": {"w": torch.full((2, 3), v), "b": torch.tensor([v])}}, {"steps_done": steps})


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path):
    return MemoryStore() if request.param == "memory" else DiskStore(tmp_path / "clients")


def test_get_returns_latest_state_at_or_before_the_round(store):
    assert store.get("a") is None
    for r, v in ((1, 1.0), (3, 3.0)):
        store.set_round(r)
        store.put("a", state(v, steps=r))
    for r, expected in ((1, 1.0), (2, 1.0), (3, 3.0), (9, 3.0)):
        store.set_round(r)
        got = store.get("a")
        assert torch.equal(got.slot("own")["w"], torch.full((2, 3), expected))
        assert got.meta == {"steps_done": int(expected)}
    store.set_round(0)
    assert store.get("a") is None


def test_truncate_forgets_rounds_after_the_checkpoint(store):
    for r in (1, 2, 3):
        store.set_round(r)
        store.put("a", state(float(r)))
    store.truncate(1)
    store.set_round(5)
    assert store.get("a").slot("own")["b"].item() == 1.0


def test_prune_keeps_current_and_best_only(store, tmp_path):
    for r in (1, 2, 3, 4):
        store.set_round(r)
        store.put("a", state(float(r)))
        if r != 3:  # b is not sampled in round 3
            store.put("b", state(10.0 + r))
    store.prune([4, 2])  # checkpoint at round 4, best round 2
    for r, a, b in ((2, 2.0, 12.0), (4, 4.0, 14.0)):
        store.set_round(r)
        assert store.get("a").slot("own")["b"].item() == a
        assert store.get("b").slot("own")["b"].item() == b
    if isinstance(store, DiskStore):
        assert sorted(p.name for p in (tmp_path / "clients" / "a").iterdir()) == \
            ["round-00002.safetensors", "round-00004.safetensors"]
    store.prune([4, 3])  # best round 3: b's state then is its round-2 file, which must survive
    store.set_round(3)
    assert store.get("b").slot("own")["b"].item() == 12.0


def test_disk_writes_are_atomic_and_leftovers_ignored(tmp_path):
    store = DiskStore(tmp_path)
    store.set_round(1)
    store.put("a", state(1.0))
    # a write cut off in round 2 leaves only a temporary file: never read, removed by truncate
    partial = tmp_path / "a" / "round-00002.safetensors.tmp"
    partial.write_bytes(b"half a file")
    store.set_round(2)
    assert store.get("a").slot("own")["b"].item() == 1.0
    store.truncate(1)
    assert not partial.exists()


def test_corrupt_state_file_is_named(tmp_path):
    store = DiskStore(tmp_path)
    store.set_round(1)
    store.put("a", state(1.0))
    (tmp_path / "a" / "round-00001.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="round-00001.safetensors"):
        store.get("a")


def test_disk_and_memory_checkpoint_state(tmp_path):
    disk = DiskStore(tmp_path)
    disk.set_round(3)
    assert disk.state_dict() == {"kind": "disk", "round": 3, "files": {}}  # a reference: the files are the state
    mem = MemoryStore()
    mem.set_round(2)
    mem.put("a", state(2.0))
    copy = MemoryStore()
    copy.load_state_dict(mem.state_dict())
    assert torch.equal(copy.get("a").slot("own")["w"], torch.full((2, 3), 2.0))
    with pytest.raises(ValueError, match="memory"):
        disk.load_state_dict(mem.state_dict())


def test_optimizer_state_round_trips_through_a_store(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tensors, scalars = optimizer_to_slot(opt)
    store = DiskStore(tmp_path)
    store.set_round(1)
    store.put("a", ClientState({"optimizer": tensors}, {"optimizer_scalars": scalars}))
    loaded = store.get("a")
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizer_from_slot(fresh, loaded.slot("optimizer"), loaded.meta["optimizer_scalars"])
    a, b = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for k in a[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k]))
