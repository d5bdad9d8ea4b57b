"""Every public function and class of deepcompile_remat (and of its tools, dcr_bench) has a
docstring.

Public: a module-level function or class, or a method or nested class of a public class, whose
name does not start with "_". Not counted: property setters and deleters (the getter carries
the docstring) and torch.library registration callbacks (register_fake / register_kernel; the
package names them "_", so they are private anyway). Functions defined inside functions are
implementation details and are not walked.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "deepcompile_remat", ROOT / "benchmarks" / "dcr_bench")


# Decorators whose function documents nothing of its own.
_EXEMPT_DECORATORS = {"setter", "deleter", "register_fake", "register_kernel"}


def _exempt(node) -> bool:
    for d in node.decorator_list:
        if isinstance(d, ast.Attribute) and d.attr in _EXEMPT_DECORATORS:
            return True
    return False


def undocumented(source: str, filename: str = "<source>") -> list[str]:
    """'filename:line Qualified.name' for each public def or class in `source` lacking a
    docstring."""
    missing = []

    def visit(body, prefix: str) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_") or _exempt(node):
                continue
            if ast.get_docstring(node) is None:
                missing.append(f"{filename}:{node.lineno} {prefix}{node.name}")
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(source, filename).body, "")
    return missing


def test_the_walk_finds_what_lacks_a_docstring():
    source = '''
def public(): pass
def _private(): pass
def documented():
    """Yes."""
class Thing:
    def method(self): pass
    def _helper(self): pass
    @property
    def value(self):
        """The value."""
    @value.setter
    def value(self, v): pass
    class Inner:
        """Documented."""
        def deep(self): pass
@op.register_fake
def fake(x): pass
'''
    assert undocumented(source) == ["<source>:2 public", "<source>:6 Thing",
                                    "<source>:7 Thing.method", "<source>:16 Thing.Inner.deep"]


def test_every_public_function_and_class_has_a_docstring():
    missing = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            missing += undocumented(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not missing, ("public functions/classes without a docstring:\n  "
                         + "\n  ".join(missing))
