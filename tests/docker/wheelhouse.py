"""The offline wheelhouse of tests/docker/run.sh, derived from what docker/'s Dockerfiles install.

run.sh builds the images with ``PIP_NO_INDEX=1`` against a wheelhouse served on loopback, so the
wheelhouse must hold every distribution that any ``pip install`` in the Dockerfiles asks for.
Nothing here lists packages: every ``pip install`` command of every Dockerfile is read, its
``${ARG}``s expanded with the Dockerfile's own defaults, and turned into one ``pip wheel``
requirement set, together with what its stage (and the stages it is built FROM) installed
before it, as pip in the image resolves it. The project itself (a local path: ``.``, ``.[extras]``, ``/tmp/src``) becomes
``.[extras]`` of a stub holding only pyproject.toml (its dependencies, as the Dockerfile's own
stub installs them), plus its build backend. A ``pip install`` this module cannot read is an
error, never skipped, so a new dependency cannot be left out of the wheelhouse silently
(tests/test_compose_wheelhouse.py runs it in the normal suite).

    python3 tests/docker/wheelhouse.py requirements      # one pip-wheel requirement set a line
    python3 tests/docker/wheelhouse.py stamp             # digest of those sets + pyproject.toml
    python3 tests/docker/wheelhouse.py build DIR         # pip wheel every set into DIR
    python3 tests/docker/wheelhouse.py arg FILE NAME     # the default of ARG NAME in FILE
"""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("docker/Dockerfile", "docker/Dockerfile.s3-standin")

# pip install options that change where packages come from or how they are installed, not which
# ones: their values are dropped (the wheelhouse is made with the host's own pip settings).
_OPTIONS_WITH_VALUE = {
    "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--trusted-host",
    "--progress-bar", "--root-user-action", "--cache-dir", "--upgrade-strategy", "--timeout",
    "--retries",
}
_FLAGS = {
    "--no-deps", "-U", "--upgrade", "--no-cache-dir", "-q", "--quiet", "-v", "--verbose",
    "--no-index", "--disable-pip-version-check", "--no-compile", "--force-reinstall",
    "--ignore-installed", "--no-warn-script-location", "--pre",
}
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?:(:?[-+])([^${}]*))?\}|\$([A-Za-z_]\w*)")
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]*\])?(\s*[<>=!~;@].*)?$")
_LOCAL = re.compile(r"^(?P<path>[./][^\[]*)(?P<extras>\[[^\]]*\])?$")


class DockerfileError(ValueError):
    """A ``pip install`` in a Dockerfile that the wheelhouse cannot be derived from."""


@dataclass(frozen=True)
class PipInstall:
    """One ``pip install`` command: where it is, and its requirements for ``pip wheel``.

    ``requirements`` are requirement specifiers, the project as ``.[extras]`` (to be resolved in
    a directory holding a copy of pyproject.toml), or empty for the project with ``--no-deps``.
    ``installed`` is what the stage (and the stages it is built ``FROM``) installed before.
    """

    dockerfile: str
    line: int
    requirements: tuple[str, ...]
    installs_project: bool
    installed: tuple[str, ...] = ()

    @property
    def wheel_set(self) -> tuple[str, ...]:
        """What ``pip wheel`` resolves for it: pip in the image keeps what is installed (torch
        from ``TORCH_SPEC`` satisfies the ``torch`` extra), so the host resolves it all at once,
        never picking another build of a package the image already has."""
        if not self.requirements:
            return ()
        return self.installed + tuple(r for r in self.requirements if r not in self.installed)


# ------------------------------------------------------------------------------ Dockerfile text
def _instructions(text: str) -> list[tuple[int, str, str]]:
    """(first line number, KEYWORD, rest) per instruction: continuations joined, comments gone."""
    result: list[tuple[int, str, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("#"):
            continue  # a comment line, also inside a continued instruction (Docker drops those)
        if not pending:
            if not raw.strip():
                continue
            start = number
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        keyword, _, rest = " ".join(pending).strip().partition(" ")
        result.append((start, keyword.upper(), rest.strip()))
        pending = []
    return result


def _arg_definition(rest: str) -> tuple[str, str | None]:
    """``NAME=default`` / ``NAME`` of an ARG instruction (quotes removed as Docker does)."""
    word = shlex.split(rest)[0]
    name, eq, default = word.partition("=")
    return name, (default if eq else None)


def _expand(word: str, args: dict[str, str], where: str) -> str:
    """Shell expansion of ``$X``, ``${X}``, ``${X:-w}``, ``${X:+w}`` with the build args."""
    while True:
        match = _VARIABLE.search(word)
        if match is None:
            return word
        name = match.group(1) or match.group(4)
        if name not in args:
            raise DockerfileError(
                f"{where}: ${name} is not a build ARG of this stage; tests/docker/wheelhouse.py "
                "expands only ARGs with their defaults"
            )
        value, operator, alternative = args[name], match.group(2), match.group(3) or ""
        if operator in ("-", ":-"):
            value = value if (value or operator == "-") else alternative
        elif operator in ("+", ":+"):
            value = alternative if (value or operator == "+") else ""
        word = word[: match.start()] + value + word[match.end():]


def _commands(script: str) -> list[list[str]]:
    """The simple commands of a RUN line's shell script, split at ``&&``, ``;``, ``|`` ..."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in _SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def _pip_install_arguments(command: list[str]) -> list[str] | None:
    """The arguments after ``pip install`` (also ``python3 -m pip install``), else None."""
    words = list(command)
    if words and re.fullmatch(r"(.*/)?python3?(\.\d+)?", words[0]) and words[1:3] == ["-m", "pip"]:
        words = ["pip", *words[3:]]
    if words and re.fullmatch(r"(.*/)?pip3?(\.\d+)?", words[0]) and words[1:2] == ["install"]:
        return words[2:]
    return None


# ------------------------------------------------------------------------------- pip install
def _requirements(arguments: list[str], where: str) -> tuple[tuple[str, ...], bool]:
    """(requirements for ``pip wheel``, installs the project?) of one ``pip install``."""
    requirements: list[str] = []
    project = False
    no_deps = "--no-deps" in arguments
    skip_value = False
    for word in arguments:
        if skip_value:
            skip_value = False
        elif word.startswith("-"):
            option = word.split("=", 1)[0]
            if option in _OPTIONS_WITH_VALUE:
                skip_value = "=" not in word
            elif option not in _FLAGS:
                raise DockerfileError(
                    f"{where}: pip install option {word!r} is not understood by "
                    "tests/docker/wheelhouse.py (requirement files and constraints included): "
                    "install through pyproject.toml extras or a plain requirement, or teach it"
                )
        elif (local := _LOCAL.match(word)) is not None:
            project = True  # the build context's only Python project is featurestore itself
            if not no_deps:
                requirements.append("." + (local.group("extras") or ""))
        elif _REQUIREMENT.match(word):
            requirements.append(word)
        else:
            raise DockerfileError(f"{where}: {word!r} is not a requirement or a local path")
    if not requirements and not project:
        raise DockerfileError(f"{where}: pip install with nothing to install")
    return tuple(requirements), project


def pip_installs(path: Path) -> list[PipInstall]:
    """Every ``pip install`` of a Dockerfile, with each stage's ARG defaults expanded."""
    name = path.name
    global_args: dict[str, str] = {}
    stage_args: dict[str, str] | None = None  # None: before the first FROM
    installed_by_stage: dict[str, tuple[str, ...]] = {}
    installed: tuple[str, ...] = ()
    stage: str | None = None
    found: list[PipInstall] = []
    for line, keyword, rest in _instructions(path.read_text(encoding="utf-8")):
        if keyword == "FROM":
            parts = [part for part in rest.split() if not part.startswith("--")]  # --platform
            stage_args = {}
            installed = installed_by_stage.get(parts[0].lower(), ())  # FROM an earlier stage
            stage = parts[2].lower() if len(parts) == 3 and parts[1].upper() == "AS" else None
        elif keyword == "ARG":
            arg, default = _arg_definition(rest)
            if stage_args is None:
                global_args[arg] = default or ""
            else:  # `ARG NAME` in a stage brings the global default in
                stage_args[arg] = default if default is not None else global_args.get(arg, "")
        elif keyword == "RUN" and stage_args is not None:
            for command in _commands(rest):
                arguments = _pip_install_arguments(command)
                if arguments is None:
                    continue
                where = f"{name}:{line}"
                words = [w for a in arguments for w in _expand(a, stage_args, where).split()]
                requirements, project = _requirements(words, where)
                install = PipInstall(name, line, requirements, project, installed)
                found.append(install)
                installed = install.wheel_set or installed
        if stage is not None:
            installed_by_stage[stage] = installed
    return found


def build_requirements(pyproject: Path) -> tuple[str, ...]:
    """The project's build backend (pip builds the local project in every image)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with open(pyproject, "rb") as f:
        return tuple(tomllib.load(f)["build-system"]["requires"])


def requirement_sets(repo: Path = REPO) -> list[tuple[str, ...]]:
    """One ``pip wheel`` requirement set per distinct ``pip install`` of the Dockerfiles."""
    sets: list[tuple[str, ...]] = []
    installs = [install for d in DOCKERFILES for install in pip_installs(repo / d)]
    if any(install.installs_project for install in installs):
        sets.append(build_requirements(repo / "pyproject.toml"))
    for install in installs:
        if install.wheel_set and install.wheel_set not in sets:
            sets.append(install.wheel_set)
    return sets


def stamp(repo: Path = REPO) -> str:
    """Changes whenever the wheelhouse's contents would: the sets and the extras they name."""
    digest = hashlib.sha256()
    for requirements in requirement_sets(repo):
        digest.update((" ".join(requirements) + "\n").encode())
    digest.update((repo / "pyproject.toml").read_bytes())
    return digest.hexdigest()[:16]


def build(out: Path, repo: Path = REPO) -> None:
    """``pip wheel`` every set into ``out`` with this interpreter's pip and its settings.

    ``pip wheel`` (not download): an sdist is built here, so the images need no compiler. The
    project resolves in a stub directory holding pyproject.toml only, as in the Dockerfile, and
    its own wheel is removed: the images always install it from the build context.
    """
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="featurestore-stub-") as stub:
        stub_dir = Path(stub)
        (stub_dir / "pyproject.toml").write_bytes((repo / "pyproject.toml").read_bytes())
        (stub_dir / "README.md").touch()
        for package in ("featurestore", "server", "client"):
            (stub_dir / package).mkdir()
            (stub_dir / package / "__init__.py").touch()
        for requirements in requirement_sets(repo):
            print(f"pip wheel {' '.join(requirements)}", flush=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(out.resolve()), *requirements],
                cwd=stub_dir, check=True,
            )
    for wheel in out.glob("featurestore-*"):
        wheel.unlink()


def arg_default(path: Path, name: str) -> str:
    """The default of ``ARG name`` in a Dockerfile (its first definition with a value)."""
    for _, keyword, rest in _instructions(path.read_text(encoding="utf-8")):
        if keyword == "ARG":
            arg, default = _arg_definition(rest)
            if arg == name and default is not None:
                return default
    raise DockerfileError(f"{path.name}: no ARG {name}=<default>")


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    try:
        if command == "requirements" and len(argv) == 1:
            for requirements in requirement_sets():
                print(" ".join(requirements))
        elif command == "stamp" and len(argv) == 1:
            print(stamp())
        elif command == "build" and len(argv) == 2:
            build(Path(argv[1]))
        elif command == "arg" and len(argv) == 3:
            print(arg_default(Path(argv[1]), argv[2]))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except DockerfileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
