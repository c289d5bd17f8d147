"""The trainer interface stays small and owned: what stepping/ and measure/ may use of a trainer
is stepping.protocol.Trainer's members (at most eight), read from the source; no module outside
the trainers' own (training/, flash/) assigns an attribute of a trainer; every registered
trainer provides the interface."""

import ast
import os

import models
import trainers
from dp_cost.stepping import protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_MEMBERS = 8


def interface_members() -> set[str]:
    """The Trainer protocol's annotated attributes and methods, from the source."""
    tree = ast.parse(open(protocol.__file__, encoding="utf-8").read())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    members = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            members.add(node.name)
    return members


def test_the_trainer_interface_has_at_most_eight_members():
    members = interface_members()
    assert 0 < len(members) <= MAX_MEMBERS, sorted(members)


def users_of_a_trainer(path: str):
    """(line, attribute) of every ``<x>.trainer.<attribute>`` or ``trainer.<attribute>`` read in
    a file, and of every assignment to one."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    assigned = {
        id(target)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        named = (isinstance(owner, ast.Name) and owner.id == "trainer") or (
            isinstance(owner, ast.Attribute) and owner.attr == "trainer"
        )
        if named:
            yield node.lineno, node.attr, id(node) in assigned


def runner_side_files():
    for folder in ("stepping", "measure"):
        directory = os.path.join(ROOT, "dp_cost", folder)
        for name in sorted(os.listdir(directory)):
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def test_stepping_and_measure_use_only_the_interface_and_assign_nothing():
    allowed = interface_members()
    found = []
    for path in runner_side_files():
        for line, attribute, is_assignment in users_of_a_trainer(path):
            if is_assignment or attribute not in allowed:
                found.append(f"{os.path.relpath(path, ROOT)}:{line}: trainer.{attribute}")
    assert not found, found


def test_every_registered_trainer_provides_the_interface():
    for name in trainers.TRAINERS:
        runner = trainers.make_trainer(
            name, models.build_model("tiny", hidden_dim=16, num_heads=2, mlp_dim=16), lr=0.1,
            batch_size=2,
        )  # fmt: skip
        for member in interface_members():
            assert hasattr(runner.trainer, member), (name, member)
        assert (runner.trainer.privacy is None) == (name == "standard"), name


def test_a_capturable_trainer_says_what_a_capture_needs():
    """A trainer's class says it can be captured (``capturable``, read before it is built) and
    its object says what a capture needs (``capture``): one holds where the other does."""
    for name, cls in trainers.TRAINERS.items():
        runner = trainers.make_trainer(
            name, models.build_model("tiny", hidden_dim=16, num_heads=2, mlp_dim=16), lr=0.1,
            batch_size=2,
        )  # fmt: skip
        assert (runner.trainer.capture is not None) == cls.capturable, name
