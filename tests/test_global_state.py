"""No module-global mutable state in ``autopar/runtime`` and ``autopar/planner`` (issue 45).

State belongs to the object that owns it (a ``ParallelModel``'s parts, a search's context). What a
module may hold at its top level: constants of immutable types (tuples, frozensets,
``MappingProxyType``), locks, ``contextvars.ContextVar`` handles (per-thread "active" state,
documented where declared), and ``ALLOWED`` below: each entry a cache with a bound, or state that
the process itself owns (its exit, its file descriptors, its CPU affinity, its default process
group), with the reason. The scan reads the source with ``ast``: module-level assignments whose
value is a mutable container (a list, dict or set display or comprehension, a set expression, or
a call that builds one, ``BoundedMemo`` included so that every memo is listed with its bound) or
``None`` (a slot filled later), module-level functions memoised without a bound
(``functools.cache``, ``lru_cache(maxsize=None)``) that take arguments, and every ``global``
statement.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("autopar/runtime", "autopar/planner")

# "path:NAME": why it may stay. Keep it short: a new entry needs a bound or an owner that is the
# process itself; moving state onto its object takes an entry out.
ALLOWED = {
    # bounded caches (planner/bounded_memo.py: least recently used dropped, values pure functions of keys)
    "autopar/planner/contexts.py:_CONTEXTS": "CostContext per (mesh, cluster, precision, optimizer, counts); MEMO_SIZE (8)",
    "autopar/planner/attempts.py:RESULTS": "search results per planning inputs; MEMO_SIZE (8)",
    "autopar/planner/attempts.py:_GRAPH_KEYS": "a traced graph's hash, checked by weak reference; 4 * MEMO_SIZE (32)",
    "autopar/planner/pipeline_search.py:_INNER": "a stage submesh's per-operator plan per planning inputs; 8",
    "autopar/planner/op_memory.py:_CACHE": "OpMemory per op signature (target, shapes, dtypes); 8192",
    "autopar/planner/bounded_memo.py:_PER_OBJECT": "what the planner derives from one traced graph or fx graph alone, "
                                                   "checked by weak reference; 16",
    "autopar/runtime/in_place.py:@cache _in_place_class": "one Autopar<cls> per model class: bounded by the classes the "
                                                         "program defines; a dropped entry would make a second class",
    # state the process owns
    "autopar/runtime/parallel_model.py:_LIVE": "the open models, for the atexit close (weak references: bounded by the live ones)",
    "autopar/runtime/parallel_model.py:_EXIT_STATE": "whether any model was built: the atexit pause for gloo's threads",
    "autopar/runtime/launch.py:_GROUP_TIMEOUT": "the timeout autopar gave the process's default group (one entry, keyed by its id)",
    "autopar/runtime/cpu_affinity.py:_state": "this process's CPU pinning, done once (two entries)",
    "autopar/planner/ilp.py:_QUIET_STATE": "the redirection of the process's fd 1 around solver calls (nesting depth, saved fds)",
    "autopar/planner/threads.py:_HOLDS": "threading.local: each planner thread's own priority and turn",
    # debt (issue 45 item 2): the program's reshard ops find their mesh here, in the forward and in
    # backward on autograd threads (so no ContextVar); it goes when the IR's ops carry their ParallelModel's comm
    "autopar/runtime/collectives.py:_ACTIVE": "the stack of active meshes (entered and left per step: at most the nesting depth)",
}

_MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque",
                  "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local", "count", "BoundedMemo"}


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return None


def _is_mutable(value: ast.AST | None) -> bool:
    if value is None:
        return False
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.BinOp):  # {a} | {b}, [x] * n
        return _is_mutable(value.left) or _is_mutable(value.right)
    if isinstance(value, ast.Constant) and value.value is None:
        return True
    return _call_name(value) in _MUTABLE_CALLS


def _unbounded_cache(decorator: ast.AST) -> bool:
    """``functools.cache``, ``cache``, ``lru_cache(maxsize=None)`` or ``lru_cache(None)``."""
    name = decorator.id if isinstance(decorator, ast.Name) else decorator.attr if isinstance(decorator, ast.Attribute) else None
    if name == "cache":
        return True
    if _call_name(decorator) == "lru_cache":
        args = [*decorator.args, *(k.value for k in decorator.keywords if k.arg == "maxsize")]
        return bool(args) and isinstance(args[0], ast.Constant) and args[0].value is None
    return False


def module_state(source: str, rel: str) -> list[str]:
    """``rel:NAME`` for each module-level mutable binding of ``source``, and ``rel:global NAME``
    for each ``global`` statement (at any depth)."""
    tree = ast.parse(source)
    found = []
    for stmt in tree.body:
        targets, value = [], None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            targets, value = [stmt.target], stmt.value
        if _is_mutable(value):
            found += [f"{rel}:{t.id}" for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
        a = stmt.args if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if a is not None and (a.posonlyargs or a.args or a.kwonlyargs or a.vararg or a.kwarg) \
                and any(_unbounded_cache(d) for d in stmt.decorator_list):  # no arguments: one entry
            found.append(f"{rel}:@cache {stmt.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [f"{rel}:global {name}" for name in node.names]
    return found


def _scan(root: Path = REPO) -> list[str]:
    found = []
    for folder in SCANNED:
        for path in sorted((root / folder).glob("*.py")):
            found += module_state(path.read_text(), str(path.relative_to(root)))
    return found


def test_no_module_global_mutable_state():
    unexpected = [name for name in _scan() if name not in ALLOWED]
    assert unexpected == [], (
        "module-level mutable state (move it onto the object that owns it, or make it a bounded cache "
        f"and add it to ALLOWED with its bound): {unexpected}")


def test_the_allow_list_names_only_what_exists():
    """An entry whose state is gone leaves the list (the list only shrinks with the debt)."""
    assert sorted(set(ALLOWED) - set(_scan())) == []


def test_the_scan_finds_planted_state():
    planted = ("import functools, weakref, collections\nX: dict = {}\n_Y = []\n_Z = None\n_W = weakref.WeakSet()\n"
               "_D = collections.defaultdict(list)\n_S = {1} | {2}\nOK = (1, 2)\nFROZEN = frozenset({1})\n"
               "@functools.cache\ndef once():\n    return 1\n"
               "@functools.lru_cache(maxsize=None)\ndef g(x):\n    return x\n"
               "@functools.lru_cache(maxsize=64)\ndef h(x):\n    return x\n"
               "def f():\n    global _Z\n    _Z = 1\n")
    assert module_state(planted, "m.py") == ["m.py:X", "m.py:_Y", "m.py:_Z", "m.py:_W", "m.py:_D", "m.py:_S",
                                             "m.py:@cache g", "m.py:global _Z"]


def test_a_planted_module_dict_in_the_runtime_fails_the_check(tmp_path):
    """The whole check, on a copy of the scanned packages with one module-level dict added to the
    runtime: that dict, and only it, is named."""
    import shutil

    for folder in SCANNED:
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    comm = tmp_path / "autopar/runtime/comm.py"
    comm.write_text(comm.read_text() + "\n_SEEN: dict = {}\n")
    assert [name for name in _scan(tmp_path) if name not in ALLOWED] == ["autopar/runtime/comm.py:_SEEN"]


def test_a_bounded_memo_holds_at_most_its_bound_dropping_the_least_recently_used():
    from autopar.planner.bounded_memo import BoundedMemo

    memo = BoundedMemo(2)
    made = []
    for key in ["a", "b", "a", "c", "b"]:  # "a" used again before "c" arrives: "b" is the one dropped
        memo.get_or_make(key, lambda k=key: made.append(k) or k.upper())
    assert made == ["a", "b", "c", "b"]
    assert len(memo) == 2 and "b" in memo and "c" in memo and "a" not in memo
    assert memo.get("c") == "C" and memo.get("a", "absent") == "absent"
