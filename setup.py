"""Build steps: compile ``protos/**/*.proto`` into ``ace_extproc/_proto`` with grpcio-tools,
and the native code ``ace_extproc/native/_speedups.c`` and ``_lru.c`` (optional: without
a C compiler the package runs on its Python references, which give the same results).

Everything else about the package is in pyproject.toml. This runs as part of
``build_py``, which every build runs: a wheel, an sdist's wheel, and an editable
install (``pip install -e .``), so the generated modules are never checked in.
After editing a proto, reinstall (``make test`` does when a proto changed).

protoc names a proto's Python module after its path under ``protos/``
(``ace/admin/v1/admin_pb2.py``) and imports it absolutely (``from ace.admin.v1
import admin_pb2``); the generated imports are rewritten to live under
``ace_extproc._proto``, so nothing outside the package is importable as ``ace``.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"
PACKAGE = "ace_extproc._proto"
OUT = ROOT / "ace_extproc" / "_proto"


def _runtime_floor(package: str) -> tuple[int, ...]:
    """The version of ``package`` pyproject.toml requires at least."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(rf"{package}\s*>=\s*([0-9.]+)", dep.strip())
        if m:
            return _version(m.group(1))
    raise SystemExit(f"setup.py: pyproject.toml must require {package}>=X.Y.Z")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def compile_protos() -> list[str]:
    """Generate the modules; return the packages they make."""
    import grpc_tools  # a build requirement (pyproject [build-system])
    from grpc_tools import protoc

    protos = sorted(PROTOS.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"setup.py: no .proto files under {PROTOS}")
    shutil.rmtree(OUT, ignore_errors=True)  # nothing stale from a removed proto
    OUT.mkdir(parents=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTOS}",
        f"--proto_path={well_known}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"setup.py: protoc failed on {', '.join(map(str, protos))}")
    # protoc's absolute imports of our own protos, made package-relative.
    roots = sorted({p.relative_to(PROTOS).parts[0] for p in protos})
    absolute = re.compile(rf"^(from|import) ({'|'.join(map(re.escape, roots))})(\.|\s)", re.M)
    for path in [*OUT.rglob("*.py"), *OUT.rglob("*.pyi")]:
        text = path.read_text()
        path.write_text(absolute.sub(rf"\1 {PACKAGE}.\2\3", text))
    _check_gencode()
    packages = []
    for folder in sorted({OUT, *(p.parent for p in OUT.rglob("*.py"))}):
        for parent in [folder, *folder.parents]:
            if parent == OUT.parent:
                break
            (parent / "__init__.py").touch()
            name = ".".join(parent.relative_to(ROOT).parts)
            if name not in packages:
                packages.append(name)
    (OUT / "py.typed").touch()
    return sorted(packages)


def _check_gencode() -> None:
    """Generated code refuses a protobuf runtime older than the protoc that made it,
    and a grpcio older than the grpcio-tools that made it: make sure pyproject.toml's
    floors are not older, so an install never gets a runtime its stubs refuse."""
    made = re.compile(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),")
    grpc_made = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", re.M)
    for path in [*OUT.rglob("*_pb2.py"), *OUT.rglob("*_pb2_grpc.py")]:
        text = path.read_text()
        found = []
        if m := made.search(text):
            found.append(("protobuf", ".".join(m.groups())))
        if m := grpc_made.search(text):
            found.append(("grpcio", m.group(1)))
        for package, version in found:
            floor = _runtime_floor(package)
            if _version(version) > floor:
                raise SystemExit(
                    f"setup.py: this grpcio-tools generates code for {package} {version}, "
                    f"newer than pyproject.toml's floor {package}>={'.'.join(map(str, floor))}: "
                    "raise the floor, or pin grpcio-tools in [build-system] to match it"
                )


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        packages = compile_protos()
        self.packages = [*(self.packages or []), *(p for p in packages if p not in self.packages)]
        for name in packages:
            self.package_data.setdefault(name, []).extend(["*.pyi", "py.typed"])
        self.distribution.packages = self.packages
        super().run()


SPEEDUPS = Extension(
    "ace_extproc.native._speedups",
    sources=[
        "ace_extproc/native/_speedups.c",
        "ace_extproc/native/_lru.c",
    ],
    include_dirs=["third_party/xxhash"],  # xxHash's single header, BSD-2-Clause
    extra_compile_args=["-O3"],
    optional=True,
)

setup(cmdclass={"build_py": BuildPyWithProtos}, ext_modules=[SPEEDUPS])
