"""Skills: named bundles of instructions (and the tools they need) that a configured agent's `skills`
select (docs/routing.md "Skills").

A skill is a folder `<skills dir>/<name>/` holding `SKILL.md`: an optional YAML front matter between
`---` lines (`description`, and `tools`: host tools the skill needs, which the agent is then offered
unless its config denies them), then the instructions, which go into the agent's system prompt under
the skill's name. The host searches its skills directories in order (the first folder of a name wins).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from agent_host.tools import SPECS

SKILL_FILE = "SKILL.md"
MAX_SKILL_BYTES = 32 * 1024
"""A skill's instructions go into every prompt of its agents: kept small."""


class SkillError(ValueError):
    """A skill that cannot be used; the message names the skill, the file and why."""


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    instructions: str
    tools: tuple[str, ...] = ()
    path: Path | None = None

    def prompt(self) -> str:
        head = f"## Skill: {self.name}" + (f" ({self.description})" if self.description else "")
        return f"{head}\n{self.instructions.strip()}"


def load_skill(folder: Path) -> Skill:
    file = folder / SKILL_FILE
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise SkillError(f"skill {folder.name!r}: cannot read {file}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SKILL_BYTES:
        raise SkillError(f"skill {folder.name!r}: {file} is {len(raw)} bytes; at most {MAX_SKILL_BYTES}")
    text = raw.decode("utf-8", errors="replace")
    meta: dict = {}
    if text.startswith("---\n"):
        head, sep, body = text[4:].partition("\n---")
        if not sep:
            raise SkillError(f"skill {folder.name!r}: {file}: the front matter has no closing '---' line")
        try:
            meta = yaml.safe_load(head) or {}
        except yaml.YAMLError as exc:
            raise SkillError(f"skill {folder.name!r}: {file}: front matter is not YAML: {exc}") from None
        if not isinstance(meta, dict):
            raise SkillError(f"skill {folder.name!r}: {file}: the front matter must be a mapping")
        text = body.partition("\n")[2]
    unknown = set(meta) - {"name", "description", "tools"}
    if unknown:
        raise SkillError(f"skill {folder.name!r}: {file}: unknown front-matter keys {sorted(unknown)}; known: name,"
                         " description, tools")
    tools = meta.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise SkillError(f"skill {folder.name!r}: {file}: tools must be a list of tool names")
    bad = [t for t in tools if t not in SPECS]
    if bad:
        raise SkillError(f"skill {folder.name!r}: {file}: unknown tools {bad}; the tools are {sorted(SPECS)}")
    return Skill(name=folder.name, description=str(meta.get("description") or "").strip(),
                 instructions=text.strip(), tools=tuple(tools), path=file)


class SkillLibrary:
    """The skills a host can give its agents, from its skills directories."""

    def __init__(self, dirs: list[Path] | tuple[Path, ...] = ()):
        self.dirs = tuple(Path(d) for d in dirs)
        self._found: dict[str, Skill] = {}

    def names(self) -> list[str]:
        found = set()
        for folder in self.dirs:
            if folder.is_dir():
                found |= {p.name for p in folder.iterdir() if (p / SKILL_FILE).is_file()}
        return sorted(found)

    def get(self, name: str) -> Skill:
        skill = self._found.get(name)
        if skill is not None:
            return skill
        for folder in self.dirs:
            if (folder / name / SKILL_FILE).is_file():
                skill = self._found[name] = load_skill(folder / name)
                return skill
        searched = ", ".join(str(d) for d in self.dirs) or "(no skills directories)"
        raise SkillError(f"no skill {name!r} in {searched}")

    def select(self, names: list[str] | None) -> list[Skill]:
        """The skills named (None: every skill the library has)."""
        return [self.get(n) for n in (self.names() if names is None else names)]
