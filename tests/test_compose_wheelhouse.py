"""The end-to-end test's wheelhouse (tests/docker/run.sh and wheelhouse.py): it covers every pip
install of the Dockerfiles and the extras they name, and resolves each stage as pip would."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from _docker_paths import DOCKERFILE, REPO, RUN_SH, STANDIN_DOCKERFILE, wheelhouse


# ---------------------------------------------------- the end-to-end test's wheelhouse (run.sh)
def _code_lines(path: Path) -> str:
    return "\n".join(l for l in path.read_text(encoding="utf-8").splitlines() if not l.lstrip().startswith("#"))


def test_wheelhouse_covers_every_pip_install_of_the_dockerfiles():
    """run.sh builds the images with PIP_NO_INDEX=1: each pip install must be in its wheelhouse."""
    sets = wheelhouse.requirement_sets(REPO)
    build_backend = wheelhouse.build_requirements(REPO / "pyproject.toml")
    for dockerfile in (DOCKERFILE, STANDIN_DOCKERFILE):
        installs = wheelhouse.pip_installs(dockerfile)
        # None slipped past the parser: as many as the Dockerfile has.
        assert len(installs) == len(re.findall(r"\bpip3? install\b", _code_lines(dockerfile)))
        for install in installs:
            assert not install.requirements or install.wheel_set in sets, install
            assert set(install.requirements) <= set(install.wheel_set), install
            assert not install.installs_project or build_backend in sets, install
    # The images' packages, with the Dockerfiles' defaults (the issue: numba was left out).
    flat = [r for requirements in sets for r in requirements]
    assert ".[server,s3]" in flat and ".[torch,numba]" in flat
    assert "torch==2.13.0" in flat and "moto[server]>=5,<6" in flat
    # The torch extra resolves beside the image's TORCH_SPEC, as pip in the image sees it: the
    # host must not fetch another torch (PyPI's CUDA build, 3 GB of nvidia wheels) for it.
    assert all("torch==2.13.0" in s for s in sets if any("torch" in r for r in s))


def test_the_extras_the_images_install_exist():
    """pip only warns about an unknown extra and installs nothing for it: a typo drops packages."""
    with open(REPO / "pyproject.toml", "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    named = {
        extra.strip()
        for requirements in wheelhouse.requirement_sets(REPO)
        for r in requirements if r.startswith(".[")
        for extra in r[2:-1].split(",")
    }
    assert named and named <= extras, named - extras


def test_run_sh_builds_and_stamps_the_wheelhouse_from_the_dockerfiles():
    code = _code_lines(RUN_SH)
    assert re.search(r'stamp=\$\(python3 "\$WHEELHOUSE_PY" stamp\)', code)
    assert re.search(r'python3 "\$WHEELHOUSE_PY" build "\$WH\.tmp"', code)
    assert "-m pip wheel" not in code  # no second list of packages in the script
    for requirements in wheelhouse.requirement_sets(REPO):
        for requirement in requirements:
            assert requirement not in code, f"run.sh repeats {requirement!r}"


def _copy_inputs(tmp_path: Path) -> Path:
    (tmp_path / "docker").mkdir()
    for path in (DOCKERFILE, STANDIN_DOCKERFILE, REPO / "pyproject.toml"):
        target = tmp_path / path.relative_to(REPO)
        target.write_bytes(path.read_bytes())
    return tmp_path


def test_a_new_dependency_enters_the_wheelhouse_and_its_stamp(tmp_path):
    repo = _copy_inputs(tmp_path)
    before = wheelhouse.stamp(repo)
    dockerfile = repo / "docker" / "Dockerfile"
    dockerfile.write_text(
        dockerfile.read_text(encoding="utf-8")
        + 'ARG NEW_SPEC=newdep>=1\nRUN pip install -q \\\n    "${NEW_SPEC}" "other[x]==2" && true\n',
        encoding="utf-8",
    )
    # Appended to the last stage (extract): resolved beside what that stage already installed.
    added = [s for s in wheelhouse.requirement_sets(repo) if "newdep>=1" in s]
    assert len(added) == 1 and added[0][-2:] == ("newdep>=1", "other[x]==2")
    assert "torch==2.13.0" in added[0] and ".[server,s3]" in added[0]
    after_dockerfile = wheelhouse.stamp(repo)
    assert after_dockerfile != before
    pyproject = repo / "pyproject.toml"  # an extra's contents changes: a new wheelhouse too
    pyproject.write_text(
        pyproject.read_text(encoding="utf-8").replace('"numba>=0.59"', '"numba>=0.60"'),
        encoding="utf-8",
    )
    assert wheelhouse.stamp(repo) != after_dockerfile


@pytest.mark.parametrize("run,why", [
    ("pip install -r requirements.txt", "'-r'"),
    ("pip install --constraint c.txt .", "'--constraint'"),
    ('pip install "${UNDECLARED}"', "$UNDECLARED is not a build ARG"),
    ("python3 -m pip install numba>=0.59", "'>' is not a requirement"),
    ("pip install", "nothing to install"),
])
def test_a_pip_install_the_wheelhouse_cannot_read_is_an_error(tmp_path, run, why):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM scratch\nRUN true \\\n && {run}\n", encoding="utf-8")
    with pytest.raises(wheelhouse.DockerfileError, match=re.escape(why)) as error:
        wheelhouse.pip_installs(dockerfile)
    assert str(error.value).startswith("Dockerfile:2: ")


def test_build_args_expand_as_the_shell_does(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "ARG EXTRAS=a,b\nFROM scratch\nARG EXTRAS\nARG LINKS=\nARG SPEC=x==1\n"
        'RUN pip install --index-url "https://i" ${LINKS:+--find-links=${LINKS}} "${SPEC}" \\\n'
        '      ".[${EXTRAS}]" && pip uninstall -y x && pip install --no-deps /tmp/src\n'
        "FROM scratch\nARG SPEC\nRUN pip install ${SPEC:-y==2}\n",
        encoding="utf-8",
    )
    installs = wheelhouse.pip_installs(dockerfile)
    assert [(i.line, i.requirements, i.installs_project) for i in installs] == [
        (6, ("x==1", ".[a,b]"), True),
        (6, (), True),
        (10, ("y==2",), False),  # a stage's ARG without a global default is empty
    ]


def test_a_stage_resolves_beside_what_it_and_its_parent_stages_installed(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM scratch AS deps\nRUN pip install a==1\n"
        "FROM deps AS job\nRUN pip install b==1 && pip install --no-deps /src\nRUN pip install c\n"
        "FROM scratch AS other\nRUN pip install d\n",
        encoding="utf-8",
    )
    assert [i.wheel_set for i in wheelhouse.pip_installs(dockerfile)] == [
        ("a==1",), ("a==1", "b==1"), (), ("a==1", "b==1", "c"), ("d",)
    ]
