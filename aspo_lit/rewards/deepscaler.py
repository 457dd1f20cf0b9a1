"""DeepScaleR's math verifier, one of the paper's two ("the official verification functions from
both DeepScaleR and Math-Verify", Appendix B; docs/grading.md).

Written from DeepScaleR's public source, ``deepscaler/rewards/math_utils/utils.py`` of
agentica-project/deepscaler (the same file is Archer2.0's ``rewards/math_utils/utils.py`` and
Skywork-OR1's ``verl/utils/reward_score/deepscaler_math/utils/utils.py``). Its grade is
``grade_answer_mathd(answer, gold) or grade_answer_sympy(answer, gold)`` on the content of the
last ``\\boxed{...}`` (``extract_boxed``):

* ``grade_answer_mathd``: the MATH benchmark's string normalisation (Hendrycks et al.), then
  equality;
* ``grade_answer_sympy``: a second normalisation (units and number words dropped, LaTeX turned into
  text by pylatexenc, lower case), then per tuple element: integers and fractions must match as
  written, anything else is equal when ``sympy.simplify(gold - answer) == 0``; sympy is only
  called on expressions with at most two distinct letters and no power written ``^{``, ``^(``,
  ``^ab`` or ``^a^`` (DeepScaleR's own guards against hangs).

What this module adds, so that any input gets a verdict in bounded time and memory (never a
verdict DeepScaleR reaches differently when it finishes):

* answers and golds longer than ``MAX_ANSWER_CHARS`` or nested deeper than ``MAX_BRACE_DEPTH``
  are rejected unread (``aspo_lit.rewards.math``, as for math-verify);
* DeepScaleR's power guards also read Python's ``**``, which ``parse_expr`` takes as a power;
* ``parse_expr`` evaluates Python: it only sees letters, digits and arithmetic signs;
* an expression is parsed unevaluated first, and one whose exact value could exceed
  ``MAX_RESULT_DIGITS`` digits (a tower such as ``((9^9)^9)^9...``, a factorial of a big number:
  big-integer arithmetic in C, where no signal lands) is not evaluated;
* ``deepscaler_correct`` is bounded from outside: ``aspo_lit.rewards.math.grading_deadline`` in a
  main thread, ``aspo_lit.rewards.pool`` elsewhere.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import warnings

from aspo_lit.rewards.math import too_risky

logger = logging.getLogger(__name__)

__all__ = [
    "deepscaler_correct",
    "extract_boxed",
    "grade_answer_mathd",
    "grade_answer_sympy",
    "load_deepscaler",
    "mathd_normalize",
    "sympy_normalize",
]

MAX_RESULT_DIGITS = 100_000  # an exact number with more digits is not computed (9^(9^6): 0.1 s)


# --------------------------------------------------------------------------- extraction


def extract_boxed(text: str) -> str | None:
    """DeepScaleR's ``extract_answer``: the content of the last ``\\boxed{...}``, None when the
    last ``\\boxed`` has no balanced ``{...}`` right after it (``\\boxed 5`` and ``\\fbox`` are
    not read)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                boxed = text[start : end + 1]
                return boxed[len("\\boxed{") : -1] if boxed.startswith("\\boxed{") else None
    return None


# --------------------------------------------------------------------------- mathd normalisation

_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def _unwrap_text(answer: str) -> str:
    m = _TEXT_ONLY.search(answer)
    return m.group("text") if m else answer


def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1b`` -> ``\\frac{1}{b}``, ``\\frac1{72}`` ->
    ``\\frac{1}{72}``; a ``\\frac`` with fewer than two characters after it leaves ``s`` as is."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[0] == "{":  # an empty part raises IndexError: mathd then keeps the raw answer
            out += part
        elif len(part) < 2:
            return s
        elif part[1] == "{":
            out += "{" + part[0] + "}" + part[1:]
        else:
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return out


def _frac_from_slash(s: str) -> str:
    """``3/4`` (two integers written plainly) -> ``\\frac{3}{4}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _drop_right_units(s: str) -> str:
    """``5\\text{ cm}`` -> ``5``; more than one ``\\text{ `` is an error (mathd keeps the raw answer)."""
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError("more than one unit")
    return parts[0]


def _braced_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def _mathd_strip(s: str) -> str:
    """The MATH benchmark's answer normalisation, step by step as DeepScaleR runs it."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _drop_right_units(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        s = sides[1]
    s = _braced_sqrt(s)
    s = s.replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _frac_from_slash(s)


@functools.lru_cache(maxsize=4096)
def mathd_normalize(answer: str) -> str:
    """DeepScaleR's ``mathd_normalize_answer``: the answer unwrapped from a whole-answer
    ``\\text{}``, then normalised; on any error in the normalisation, the unwrapped answer."""
    answer = _unwrap_text(answer.strip()).strip()
    try:
        return _mathd_strip(answer)
    except (IndexError, ValueError):
        return answer


def grade_answer_mathd(given: str, gold: str) -> bool:
    """Equal after the MATH normalisation."""
    return mathd_normalize(given) == mathd_normalize(gold)


# --------------------------------------------------------------------------- sympy normalisation

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
          "month", "year", "foot", "feet", "inch", "yard")
_UNIT_RES = [re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS]
_LATEX_SYMBOLS = {"√": "sqrt", "π": "pi", "∞": "inf", "∪": "U", "·": "*", "×": "*"}


@functools.lru_cache(maxsize=1)
def _latex_to_text_converter():
    from pylatexenc.latex2text import LatexNodes2Text

    # a model's malformed LaTeX (e.g. a bare "\\frac1") would log a warning per answer graded
    logging.getLogger("pylatexenc").setLevel(logging.ERROR)
    return LatexNodes2Text()


def _latex_to_text(expr: str) -> str:
    """LaTeX -> plain text with pylatexenc, as DeepScaleR's ``_parse_latex`` does."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = _latex_to_text_converter().latex_to_text(expr)
    for symbol, word in _LATEX_SYMBOLS.items():
        expr = expr.replace(symbol, word)
    return expr.strip()


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")


def _strip_thousands_commas(expr: str) -> str:
    """``1,000,000`` -> ``1000000``, leaving tuple commas."""
    while True:
        stripped = _THOUSANDS_COMMA.sub(r"\1\3\4", expr)
        if stripped == expr:
            return expr
        expr = stripped


def _str_is_int(s: str) -> bool:
    try:
        return _is_int(float(_strip_thousands_commas(s)))
    except ValueError:
        return False


def _str_to_int(s: str) -> int:
    return int(float(s.replace(",", "")))


@functools.lru_cache(maxsize=4096)
def sympy_normalize(expr: str) -> str:
    """DeepScaleR's ``_normalize``: the text that ``grade_answer_sympy`` compares and parses."""
    expr = _unwrap_text(expr)
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_RES:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # noqa: BLE001 - pylatexenc fails on malformed LaTeX: DeepScaleR keeps the text
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: "7 3/4" -> "7+3/4"
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


# --------------------------------------------------------------------------- sympy equality

_TUPLE_CHARS = "()[]"
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_POWERS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_PARSEABLE = re.compile(r"[\w+\-*/^().,!\[\] ]*")
_HUGE_FLOAT = re.compile(r"[\d.]e[-+]?0*\d{5}")  # 1e99999 takes 1 s to parse, 1e999999 minutes
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")


def _split_tuple(expr: str) -> list[str]:
    """The elements of ``(a,b)`` / ``[a,b)`` ... (no nested brackets), else ``[expr]``."""
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    if (len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
            and not any(ch in expr[1:-1] for ch in _TUPLE_CHARS)):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def _sympy_allowed(expr: str) -> bool:
    """DeepScaleR's ``should_allow_eval`` (``**`` read as ``^``), and nothing but arithmetic."""
    powers = expr.replace("**", "^")
    letters = {ch for ch in powers.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    return (len(letters) <= 2
            and not any(bad in powers for bad in _BAD_SUBSTRINGS)
            and not any(bad.search(powers) for bad in _BAD_POWERS)
            and "__" not in expr and _PARSEABLE.fullmatch(expr) is not None
            and _HUGE_FLOAT.search(expr) is None)


def _parse(expr: str, evaluate: bool):
    """``parse_expr`` as DeepScaleR calls it; unevaluated, no function is evaluated either."""
    import sympy
    from sympy.parsing import sympy_parser

    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    with sympy.evaluate(evaluate):
        return sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations,
                                       evaluate=evaluate)


def _digits(node) -> float:
    """An upper bound on the decimal digits of the exact value of an unevaluated expression
    (0 for what stays symbolic or floating point)."""
    import sympy

    if node.is_Integer:
        return int(node).bit_length() * math.log10(2)
    if node.is_Rational:
        return max(_digits(sympy.Integer(node.p)), _digits(sympy.Integer(node.q)))
    if node.is_Pow:
        base, exponent = (_digits(arg) for arg in node.args)
        if base == 0 or not node.args[1].is_number:
            return base
        return math.inf if exponent > 7 else base * 10**exponent
    inner = [_digits(arg) for arg in node.args]
    if isinstance(node, (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.RisingFactorial,
                         sympy.FallingFactorial, sympy.binomial, sympy.gamma)):
        return math.inf if max(inner, default=0) > 4 else 5 * 10 ** max(inner, default=0)
    if node.is_Mul:
        return sum(inner)
    return max(inner, default=0) + 1  # Add, functions: a sum of n terms adds log10(n) < 1 + ...


@functools.lru_cache(maxsize=4096)
def _equal_under_sympy(gold: str, given: str) -> bool:
    """``simplify(gold - given) == 0``, when DeepScaleR's guards and the size bound allow it.

    Cached: a pair's verdict is a function of its two strings, and pairs recur (one gold per
    group, the same wrong answers batch after batch). A timeout raised by the caller's deadline is
    a ``BaseException`` the ``except`` below lets through, so it is never cached."""
    expr = f"({gold})-({given})"
    if not _sympy_allowed(expr):
        return False
    import sympy

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sympy's deprecation notes on tuple arithmetic
            if _digits(_parse(expr, evaluate=False)) > MAX_RESULT_DIGITS:
                return False
            return sympy.simplify(_parse(expr, evaluate=True)) == 0
    except Exception:  # noqa: BLE001 - unparseable or unsimplifiable: not equal, as DeepScaleR
        return False


def _elements_equal(gold: str, given: str) -> bool:
    if _FRACTION.search(gold) and _FRACTION.search(given):
        return gold == given  # an unreduced fraction is not the reduced one
    if _str_is_int(gold) != _str_is_int(given):
        return False  # an integer gold takes an integer answer, no simplification
    return _equal_under_sympy(gold, given)


def grade_answer_sympy(given: str, gold: str) -> bool:
    """DeepScaleR's ``grade_answer_sympy``: equal after ``sympy_normalize``, or element by element
    (same brackets, same length) by the integer/fraction/sympy rules."""
    gold_norm, given_norm = sympy_normalize(gold), sympy_normalize(given)
    if gold_norm == given_norm:
        return True
    if not given_norm:
        return False
    gold_elems, given_elems = _split_tuple(gold_norm), _split_tuple(given_norm)
    if len(gold_elems) > 1 and (gold_norm[0] != given_norm[0] or gold_norm[-1] != given_norm[-1]):
        return False
    if len(gold_elems) != len(given_elems):
        return False
    return all(_elements_equal(g, a) for g, a in zip(gold_elems, given_elems))


# --------------------------------------------------------------------------- the verifier


@functools.lru_cache(maxsize=1)
def load_deepscaler() -> None:
    """Import sympy and pylatexenc once (slow); pool workers call it before taking items."""
    import sympy  # noqa: F401
    from sympy.parsing import sympy_parser  # noqa: F401

    _latex_to_text_converter()


def _grade(answer: str, gold: str) -> bool:
    return grade_answer_mathd(answer, gold) or grade_answer_sympy(answer, gold)


def deepscaler_correct(answer: str | None, gold: str) -> bool:
    """DeepScaleR's verdict on an extracted answer, never raising: False for no answer, an answer
    or gold over the size limits, an error, or a timeout raised by the caller's deadline."""
    if answer is None or not gold.strip():
        return False
    if too_risky(answer) or too_risky(gold):
        return False
    from math_verify.errors import TimeoutException

    try:
        return bool(_grade(answer, gold))
    except (Exception, TimeoutException):
        logger.debug("DeepScaleR grading failed", exc_info=True)
        return False
