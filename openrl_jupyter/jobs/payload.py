"""What travels to a job by value: the user's own modules, cloudpickle payloads, reward entries."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import inspect
import os
import sys
import sysconfig
from typing import Any

from openrl_jupyter._exceptions import OpenRLError, UsageError
from openrl_jupyter.jobs.common import (
    ALWAYS_BY_REFERENCE,
    _pickle_lock,
)
from openrl_jupyter.rewards import RewardVersion, pinned, registry


# -- what travels by value ----------------------------------------------------------------------------
def _system_dirs() -> list[str]:
    """The standard library and site-packages folders: modules there are installed, not the user's."""
    dirs = set()
    for scheme_key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(scheme_key)
        if path:
            dirs.add(os.path.realpath(path))
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        dirs.add(os.path.realpath(os.path.join(prefix, "lib")))
    with contextlib.suppress(Exception):
        import site

        dirs.update(os.path.realpath(p) for p in site.getsitepackages())
        dirs.add(os.path.realpath(site.getusersitepackages()))
    return sorted(dirs)


def _under(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def _installed_top_levels() -> set[str]:
    try:
        from importlib.metadata import packages_distributions

        return set(packages_distributions())
    except Exception:  # noqa: BLE001 - a broken metadata entry must not stop a submit
        return set()


def user_modules() -> list[str]:
    """Top-level modules of the user's own (see the module docstring): they travel by value."""
    system = _system_dirs()
    roots = [os.path.realpath(os.getcwd())]
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(path) and not _under(path, system):
            roots.append(path)
    skip = ALWAYS_BY_REFERENCE | _installed_top_levels() | set(sys.stdlib_module_names)
    found = []
    for name, module in list(sys.modules.items()):
        if "." in name or name.startswith("_") or name in skip or module is None:
            continue
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue
        path = os.path.realpath(file)
        if _under(path, system) or not _under(path, roots):
            continue
        found.append(name)
    return sorted(found)


def dumps(obj: Any, what: str) -> bytes:
    """``obj`` pickled with cloudpickle, the user's modules by value; a UsageError naming ``what``
    when something in it cannot be pickled (a lock, an open file or socket, a client...)."""
    import cloudpickle

    with _pickle_lock:
        registered = {m for m in cloudpickle.list_registry_pickle_by_value()}
        added = []
        for name in user_modules():
            if name not in registered and name in sys.modules:
                with contextlib.suppress(ValueError):
                    cloudpickle.register_pickle_by_value(sys.modules[name])
                    added.append(name)
        try:
            return cloudpickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - pickling the user's objects can raise anything
            found = _culprit(obj, set(), 3)
            if found is None:
                raise UsageError(
                    f"cannot send {what} to the process that runs it: {type(exc).__name__}: {exc}. "
                    "Something it uses cannot be copied to another process (a lock, an open file or "
                    "socket, a client, a thread...): create it inside the reward function (or at its "
                    "first call) instead of in the notebook"
                ) from None
            fn, name, value = found
            if inspect.ismodule(value):  # the user's own module, sent by value with what it holds
                bad = [k for k, v in vars(value).items() if not k.startswith("__") and not _pickles(v)]
                attr = f", whose {bad[0]!r} is what cannot travel" if bad else ""
                desc = f"your module {value.__name__}, sent by value as it is not installed{attr}"
                todo = (
                    f"create such objects inside a function of {value.__name__} at first use rather than "
                    f"at its top level, or install it (pip install -e .) so the job imports it"
                )
            else:
                desc = f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")
                todo = "create it inside the function (or at its first call) instead of in the notebook"
            raise UsageError(
                f"cannot send {what} to the process that runs it: {fn}() uses {name!r} from the notebook "
                f"({desc}), which cannot be copied to another process ({type(exc).__name__}: {exc}); {todo}"
            ) from None
        finally:
            for name in added:
                with contextlib.suppress(Exception):
                    cloudpickle.unregister_pickle_by_value(sys.modules[name])


def _referenced(fn: Any) -> dict[str, Any]:
    """The globals and closure variables a function's code (nested functions included) refers to."""
    code, names, todo = fn.__code__, set(), [fn.__code__]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if inspect.iscode(k))
    found = {n: fn.__globals__[n] for n in sorted(names) if n in fn.__globals__}
    for n, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            found[n] = cell.cell_contents
    return found


def _pickles(value: Any) -> bool:
    import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception:  # noqa: BLE001 - any failure means it cannot travel
        return False
    return True


def _culprit(obj: Any, seen: set[int], depth: int) -> tuple[str, str, Any] | None:
    """(function, name, value): the first variable a function in ``obj`` refers to that does not
    pickle, looking through dicts, lists and functions that refer to functions ``depth`` deep."""
    if id(obj) in seen or depth < 0:
        return None
    seen.add(id(obj))
    if isinstance(obj, dict):
        items: list = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif inspect.isfunction(obj):
        for name, value in _referenced(obj).items():
            if not _pickles(value):
                deeper = _culprit(value, seen, depth - 1) if inspect.isfunction(value) else None
                return deeper or (obj.__name__, name, value)
        return None
    else:
        return None
    for item in items:
        found = _culprit(item, seen, depth - (not isinstance(obj, dict)))
        if found is not None:
            return found
    return None


def encode(data: bytes) -> dict:
    """The payload fields of a request: base64 and the SHA-256 of the bytes."""
    return {
        "payload": base64.b64encode(data).decode("ascii"),
        "payload_sha256": hashlib.sha256(data).hexdigest(),
    }


def decode(entry: dict) -> Any:
    """A payload version from the service, checked against its SHA-256 and unpickled."""
    import cloudpickle

    data = base64.b64decode(entry["payload"])
    digest = hashlib.sha256(data).hexdigest()
    if entry.get("sha256") and entry["sha256"] != digest:
        raise OpenRLError(
            f"payload v{entry.get('version')}: SHA-256 {digest} is not the service's {entry['sha256']}"
        )
    return cloudpickle.loads(data)


def reward_entry(reward: Any) -> dict:
    """What a payload carries of a reward: a registered name's newest version, or a pinned function."""
    if isinstance(reward, RewardVersion):
        v, is_pinned = reward, False
    elif callable(reward):
        v, is_pinned = pinned(reward), True
    elif isinstance(reward, str):
        v, is_pinned = registry.latest(reward), False
    else:
        raise UsageError(f"reward must be a registered reward's name or a function; got {reward!r}")
    return {"name": v.name, "fn": v.fn, "per_group": v.per_group, "pinned": is_pinned, "version": v.version}
