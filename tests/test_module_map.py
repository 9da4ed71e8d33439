"""docs/design.md's module map is the code's: each room's line names every module of the room and
nothing that is not one, and the table of imports between rooms is the imports the code has —
every one of them, none more — running one way, down the list."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SKIP = {"tests", "docs", "conf", ".venv", ".venv-verl", "benchmarks", "scripts"}  # not library rooms


def _blocks() -> list[str]:
    return re.findall(r"```\n(.*?)```", DESIGN.read_text(), flags=re.S)


def _import_table() -> dict[str, set[str]]:
    """room → the rooms it imports, from the table that starts with 'room  imports'."""
    (block,) = [b for b in _blocks() if b.startswith("room ")]
    table = {}
    for line in block.splitlines()[1:]:
        room, _, rest = line.partition(" ")
        table[room] = set() if rest.strip() == "—" else {r.strip() for r in rest.split(",")}
    return table


def _room_of(parts: tuple[str, ...], rooms: list[str]) -> str | None:
    path = "/".join(parts)
    for room in sorted(rooms, key=len, reverse=True):  # the longest room holding the path
        stem = room[:-3] if room.endswith(".py") else room
        if path == stem or path.startswith(stem + "/"):
            return room
    return None


def _imported(node: ast.AST, module: tuple[str, ...], is_package: bool) -> list[tuple[str, ...]]:
    """The module paths an import statement names (a `from` import: the module and each name)."""
    if isinstance(node, ast.Import):
        return [tuple(a.name.split(".")) for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = tuple((node.module or "").split(".")) if node.module else ()
    if node.level:
        package = module if is_package else module[:-1]
        base = package[:len(package) - (node.level - 1)] + base
    return [base] + [base + (a.name,) for a in node.names]


def code_imports(rooms: list[str]) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) → the imports behind it, over every library file."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or "__pycache__" in rel.parts:
            continue
        src = _room_of(rel.with_suffix("").parts if rel.suffix else rel.parts, rooms) \
            if rel.as_posix() != "run.py" else "run.py"
        if src is None:
            continue
        module = rel.with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node, module, rel.name == "__init__.py"):
                dst = _room_of(target, rooms)
                if dst is not None and dst != src:
                    edges.setdefault((src, dst), []).append(f"{rel.as_posix()}: {'.'.join(target)}")
    return edges


def test_the_import_table_is_the_codes_imports():
    table = _import_table()
    rooms = list(table)
    found = code_imports(rooms)
    documented = {(a, b) for a, bs in table.items() for b in bs}
    undocumented = {e: found[e][:2] for e in sorted(set(found) - documented)}
    assert not undocumented, f"imports the design's table does not list: {undocumented}"
    assert not documented - set(found), f"the design's table lists imports the code no longer has: " \
                                         f"{sorted(documented - set(found))}"


def test_imports_run_one_way_down_the_table():
    table = _import_table()
    order = list(table)
    for room, imports in table.items():
        above = order[:order.index(room)]
        assert imports <= set(above), f"{room} imports {sorted(imports - set(above))}, not above it"


def _tree() -> dict[str, str]:
    """room folder (or file) → its text on the module map."""
    (block,) = [b for b in _blocks() if b.startswith("run.py ")]
    rooms, current = {}, None
    for line in block.splitlines():
        if line and not line[0].isspace():
            current, _, text = line.partition(" ")
            rooms[current] = text
        elif current is not None:
            rooms[current] += " " + line.strip()
    return rooms


def _top_level_items(text: str) -> list[str]:
    """The comma- and semicolon-separated items of a room's text, outside parentheses."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch in ",;" and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [i for i in items + [cur.strip()] if i]


def test_the_module_map_names_every_module_and_only_modules():
    tree = _tree()
    python_rooms = [r for r in tree if r.endswith("/") and r.split("/")[0] not in SKIP]
    for room in python_rooms:
        folder = ROOT / room
        assert folder.is_dir(), f"the module map names {room}, which is no folder"
        text = tree[room]
        sub_rooms = {r for r in python_rooms if r != room and r.startswith(room)}
        modules = {p.relative_to(folder).with_suffix("").parts for p in folder.rglob("*.py")
                   if p.name != "__init__.py" and "__pycache__" not in p.parts
                   and not any((ROOT / s) in p.parents for s in sub_rooms)}
        words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))
        missing = sorted("/".join(m) for m in modules if m[-1] not in words)
        assert not missing, f"{room}: modules the map does not name: {missing}"
        names = {m[0] for m in modules} | {p.name + "/" for p in folder.iterdir()
                                           if p.is_dir() and p.name != "__pycache__"}
        for item in _top_level_items(text.split(" — ", 1)[-1]):  # after a room's own caption
            for name in re.split(r" and | with ", item.split(" (")[0]):
                name = name.strip().strip("`")
                assert name in names or name + "/" in names, f"{room}: {name!r} is no module of it"
