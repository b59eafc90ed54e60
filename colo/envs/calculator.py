"""The built-in "calculator" environment: the model may put an arithmetic expression in a tool call,

    <tool_call>12*34+56</tool_call>        -> observation "464" (role "tool")

and answers in a turn without one (scored by algo.rewards, e.g. exact_match, against the row's answer).
Expressions are integers with + - * / // % ** and parentheses, evaluated from their syntax tree (no eval):
anything else, or a result past 10**12, is a tool error whose observation says what went wrong.
"""
from __future__ import annotations

import ast
import operator
import re

from colo.envs.base import Environment, Step, Turn

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Div: operator.truediv, ast.Pow: operator.pow}
LIMIT = 10**12
EXPRESSION = re.compile(r"[\d(][\d+\-*/() ]*[\d)]|\d")


def calculate(expr: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything that is not one (or too big)."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expr.strip()[:40]!r}") from e

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 64:
                raise ValueError("exponent too large")
            try:
                v = _OPS[type(node.op)](a, b)
            except ZeroDivisionError as e:
                raise ValueError("division by zero") from e
            if abs(v) > LIMIT:
                raise ValueError("result too large")
            return v
        raise ValueError(f"unsupported: {ast.unparse(node)[:40]!r}")

    return ev(tree.body)


def show(v: int | float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


class CalculatorEnv(Environment):
    """One conversation: the row's prompt as the user message; every tool call evaluated; a turn without
    one ends the conversation (its reward comes from algo.rewards)."""

    role = "tool"

    def step(self, turn: Turn) -> Step:
        calls = CALL.findall(turn.text)
        if not calls:
            return Step(None, 0.0, True)
        outs, errors = [], 0
        for expr in calls:
            try:
                outs.append(show(calculate(expr)))
            except ValueError as e:
                outs.append(f"error: {e}")
                errors += 1
        return Step("\n".join(outs), 0.0, False, tool_calls=len(calls), tool_errors=errors)

    def solution(self, row: dict) -> list[str] | None:
        """Call the calculator on the prompt's expression, then answer with its result."""
        found = EXPRESSION.findall(str(row["prompt"]))
        if not found:
            return None
        return [f"<tool_call>{max(found, key=len).strip()}</tool_call>", str(row["answer"])]
