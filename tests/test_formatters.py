"""The report's number formatters are total: every float (0, negative, tiny, huge, inf, nan) gives
short text that reads back as the same number to its shown precision."""

import math
from decimal import Decimal

from hypothesis import given, strategies as st

from reports.document import format_number, num, pct


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_format_number_is_total_and_reads_back(x: float) -> None:
    shown = format_number(x)
    assert shown and len(shown) <= 30
    if math.isnan(x):
        assert shown == "nan"
    elif math.isinf(x):
        assert shown == ("inf" if x > 0 else "-inf")
    else:
        back = Decimal(shown.replace(",", ""))  # Decimal: 1.80e+308 reads back without overflow
        # about three significant digits, or absolute 5e-9 where the value rounds to zero
        assert abs(back - Decimal(x)) <= max(Decimal(5e-3) * abs(Decimal(x)), Decimal(5e-9))


@given(st.integers(min_value=-10**18, max_value=10**18))
def test_integers_are_exact_with_thousands_separators(n: int) -> None:
    assert int(format_number(n).replace(",", "")) == n


@given(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)))
def test_table_cells_never_raise(x: float | None) -> None:
    for cell in (num(x), pct(x)):
        assert cell.text
        assert cell.value is None or cell.value == x or (math.isnan(cell.value) and math.isnan(x))


def test_zero_factor_from_a_calibration_bound_formats() -> None:
    # `advisor run` crashed at its very end on log10(0) when the fit put a factor at exactly 0.0
    assert format_number(0.0) == "0"
    assert format_number(-0.0) == "0"
