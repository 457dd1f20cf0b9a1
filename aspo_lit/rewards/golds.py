"""Gold answers rewritten as a model writes them, before grading (docs/grading.md, "Golds").

Minerva Math's official solutions box some answers as Python: e-notation (``3.83e35``, ``1e-3``)
and a few expressions (``np.arcsin(10/13)``, ``-1./3``, ``\\exp{a*t}``). Both verifiers misread
them: math-verify reads the ``e`` of ``3.83e35`` as Euler's number, so a model's
``3.83 \\times 10^{35}`` or ``0.001`` (gold ``1e-3``) scores 0. ``normalize_gold`` rewrites those
forms into LaTeX and leaves every other answer as it is.
"""

from __future__ import annotations

import re

__all__ = ["normalize_gold"]

_E_NOTATION = re.compile(r"(?P<sign>[-+]?)(?P<mantissa>\d+(?:\.\d*)?|\.\d+)[eE](?P<exponent>[-+]?\d+)")
_INT_DIVISION = re.compile(r"(?P<sign>-?)(?P<num>\d+)\.?/(?P<den>\d+)\.?")  # -1./3 or 10/13
_CODE_FUNCTION = re.compile(r"\b(?:np|numpy|math)\.(?P<name>[a-z]+)\((?P<arg>[^()]*)\)")
_EXP_CALL = re.compile(r"\\exp\{(?P<arg>[^{}]*)\}")
_PRODUCT_STAR = re.compile(r"(?<=[\w}])\*(?=[\w\\])")

_LATEX_FUNCTIONS = {"sin", "cos", "tan", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "ln"}


def _scientific(m: re.Match) -> str:
    """``3.83e35`` -> ``3.83 \\times 10^{35}``; ``1e-3`` -> ``10^{-3}``."""
    exponent = str(int(m["exponent"]))
    mantissa = m["mantissa"].rstrip(".") if m["mantissa"].endswith(".") else m["mantissa"]
    power = f"10^{{{exponent}}}"
    return m["sign"] + (power if mantissa == "1" else f"{mantissa} \\times {power}")


def _fraction(m: re.Match) -> str:
    """``-1./3`` -> ``-\\frac{1}{3}``."""
    return f"{m['sign']}\\frac{{{m['num']}}}{{{m['den']}}}"


def _code_function(m: re.Match) -> str:
    """``np.arcsin(10/13)`` -> ``\\arcsin\\left(\\frac{10}{13}\\right)``; ``np.log`` is ``\\ln``."""
    name = "ln" if m["name"] == "log" else m["name"]
    arg = _INT_DIVISION.sub(_fraction, m["arg"].strip()) if _INT_DIVISION.fullmatch(m["arg"].strip()) else m["arg"]
    if name == "sqrt":
        return f"\\sqrt{{{arg}}}"
    if name == "exp":
        return f"e^{{{arg}}}"
    if name not in _LATEX_FUNCTIONS:
        return m[0]
    return f"\\{name}\\left({arg}\\right)"


def normalize_gold(answer: str) -> str:
    """The gold ``answer`` in the LaTeX a model writes: Python e-notation, integer divisions with
    float literals (``-1./3``), ``np.<function>(...)`` and ``\\exp{...}`` rewritten; anything else
    returned unchanged. Pure: the same input always gives the same output."""
    stripped = answer.strip()
    if _E_NOTATION.fullmatch(stripped):
        return _E_NOTATION.sub(_scientific, stripped)
    if _INT_DIVISION.fullmatch(stripped) and "." in stripped:
        return _INT_DIVISION.sub(_fraction, stripped)
    rewritten = _CODE_FUNCTION.sub(_code_function, stripped)
    if "\\exp{" in rewritten:
        rewritten = _EXP_CALL.sub(lambda m: f"e^{{{m['arg']}}}", rewritten)
        rewritten = _PRODUCT_STAR.sub(" ", rewritten)
    return rewritten if rewritten != stripped else answer
