"""Checkpoints on disk: overwrite is atomic for readers, digests are checked on load, every write is
durable, and the generated key file is replaced, never written through."""

import os
import shutil
import stat

import pytest
import torch

from openrl_service.errors import UserError
from openrl_service.storage.checkpoints import CheckpointRef, CheckpointStore

REF = CheckpointRef("s1:train:0", "weights", "step-1")


def save(store: CheckpointStore, value: float, *, overwrite: bool = False, ref: CheckpointRef = REF) -> None:
    store.save(
        "alice",
        ref,
        adapter={"a": torch.full((4, 4), value)},
        adapter_config={"r": 4},
        optimizer={"m": torch.zeros(4)},
        manifest={"base_model": "openrl/tiny", "lora": {"rank": 4}},
        overwrite=overwrite,
    )


def loaded_value(store: CheckpointStore, ref: CheckpointRef = REF) -> float:
    _, adapter, _ = store.load("alice", ref, with_optimizer=True)
    return float(adapter["a"][0, 0])


def test_a_reader_sees_the_old_or_the_new_checkpoint_during_an_overwrite(tmp_path, monkeypatch):
    """At every rename and delete of an overwrite, a concurrent load finds a complete checkpoint."""
    store = CheckpointStore(tmp_path)
    save(store, 1.0)
    seen = []
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def look():
        try:
            seen.append(loaded_value(store))
        except Exception as e:  # what a concurrent reader would get
            seen.append(e)

    def replace(src, dst, *a, **kw):
        look()
        real_replace(src, dst, *a, **kw)
        look()

    def rmtree(path, *a, **kw):
        look()
        real_rmtree(path, *a, **kw)
        look()

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    save(store, 2.0, overwrite=True)
    monkeypatch.undo()
    assert seen, "the overwrite renamed or deleted nothing: the test watched nothing"
    assert all(v in (1.0, 2.0) for v in seen), seen
    assert loaded_value(store) == 2.0


@pytest.mark.parametrize(
    "name", ["adapter_model.safetensors", "optimizer.safetensors", "adapter_config.json"]
)
def test_a_corrupted_checkpoint_is_refused_naming_the_file(tmp_path, name):
    store = CheckpointStore(tmp_path)
    save(store, 1.0)
    path = store.folder("alice", REF) / name
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # one flipped bit, still parseable
    path.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        store.load("alice", REF, with_optimizer=True)
    assert name in str(e.value) and "corrupt" in str(e.value) and REF.path in str(e.value)


def test_a_checkpoint_verified_ahead_loads_unhashed_and_one_changed_since_is_hashed_again(
    tmp_path, monkeypatch
):
    from openrl_service.storage import checkpoint_read

    store = CheckpointStore(tmp_path)
    save(store, 1.0)
    hashed = []
    real = checkpoint_read.check_digest
    monkeypatch.setattr(
        checkpoint_read,
        "check_digest",
        lambda f, want, name, ref: hashed.append(name) or real(f, want, name, ref),
    )
    size = (store.folder("alice", REF) / "adapter_model.safetensors").stat().st_size
    assert store.verify("alice", REF, with_optimizer=True) >= size  # hashed now, on this thread
    assert sorted(hashed) == ["adapter_model.safetensors", "optimizer.safetensors"]
    hashed.clear()
    assert store.verify("alice", REF, with_optimizer=True) == 0  # already checked: nothing read
    assert loaded_value(store) == 1.0 and hashed == []  # the load did not hash again
    path = store.folder("alice", REF) / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # changed after it was verified: another file identity
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt"):
        store.load("alice", REF)
    assert hashed == ["adapter_model.safetensors"]


def fsynced_paths(monkeypatch) -> list[str]:
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fsynced files")
def test_a_copy_is_fsynced_like_a_save(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    save(store, 1.0)
    synced = fsynced_paths(monkeypatch)
    dst = CheckpointRef("s2:train:0", "weights", "step-1")
    store.copy("alice", REF, dst, expires_at=None)
    names = {os.path.basename(p) for p in synced}
    assert {"adapter_model.safetensors", "optimizer.safetensors", "manifest.json"} <= names, synced
    assert loaded_value(store, dst) == 1.0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fsynced files")
def test_the_generated_key_file_is_replaced_not_written_through(tmp_path, monkeypatch):
    """A stale key file (here: not a key) is replaced by a new file: another name for the old file keeps
    its bytes, the new key is fsynced before it takes the name, and only its owner can read it."""
    from openrl_service.api.auth import ensure_generated_key

    old = tmp_path / "api-key"
    old.write_text("not a key\n")
    os.link(old, tmp_path / "other-name")
    synced = fsynced_paths(monkeypatch)
    key, path, created = ensure_generated_key(tmp_path)
    assert created and key.startswith("tml-") and path.read_text().strip() == key
    assert (tmp_path / "other-name").read_text() == "not a key\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert synced, "the key was not fsynced"


def test_a_manifest_update_racing_a_delete_never_brings_back_an_empty_checkpoint(tmp_path, monkeypatch):
    """publish / set_ttl read the manifest, then write it back; a DELETE in between (another request,
    or the expiry sweep) must win: the write fails and no folder holding only a manifest appears."""
    store = CheckpointStore(tmp_path)
    save(store, 1.0)
    real_manifest = store.manifest

    def manifest_then_deleted(tenant, ref):
        out = real_manifest(tenant, ref)
        monkeypatch.setattr(store, "manifest", real_manifest)
        store.delete(tenant, ref)  # the other request's DELETE lands here
        return out

    monkeypatch.setattr(store, "manifest", manifest_then_deleted)
    with pytest.raises(FileNotFoundError):
        store.update_manifest("alice", REF, public=True)
    assert not store._ckpt_dir("alice", REF).exists()
