"""One error vocabulary: every code the code base gives a user or an agent is in the registry
(ptcproject/errors.py), and the README documents every code in it."""

import ast

from ptcproject.errors import CODES, JOB_ERROR_TYPES
from tests.stack import ROOT

APPS = ("ptcproject", "tools", "execution", "billing")
# Calls that take an error code, and where (``_tool_call_fail`` takes the call's id first, then the code).
ERROR_CALLS = {
    "ApplicationError": 0,
    "ToolFailure": 0,
    "CreditsRefused": 0,
    "call_error": 0,
    "error_body": 0,
    "_tool_call_fail": 1,
    "FieldError": 1,  # a toolset write's problem: (path, code, message); the 400 answers the first one's code
}


def _codes_used() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                found: list[ast.expr] = []
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                    if name in ERROR_CALLS and len(node.args) > ERROR_CALLS[name]:
                        found.append(node.args[ERROR_CALLS[name]])
                elif isinstance(node, ast.Dict):  # {"code": "...", ...}: a hand-built error
                    found += [
                        v
                        for k, v in zip(node.keys, node.values, strict=True)
                        if isinstance(k, ast.Constant) and k.value == "code"
                    ]
                for value in found:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        used.setdefault(value.value, set()).add(str(path.relative_to(ROOT)))
    return used


def test_every_code_in_use_is_in_the_registry() -> None:
    used = _codes_used()
    assert len(used) > 40, "the scan found too few codes: it is not reading the code base"
    unknown = {code: sorted(places) for code, places in used.items() if code not in CODES}
    assert unknown == {}, "add these to ptcproject.errors.CODES (and the README's table)"


def test_the_readme_documents_every_code_and_job_error_type() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in [*CODES, *JOB_ERROR_TYPES] if f"`{name}`" not in readme]
    assert missing == []
