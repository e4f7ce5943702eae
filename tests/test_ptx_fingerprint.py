"""benchmarks/ptx_fingerprint.py's comparison of two revisions' fingerprints (no GPU, no compile: the names and hashes
are given)."""
from helpers import benchmark_script

P = benchmark_script("ptx_fingerprint")


def test_compare_matches_the_names_without_a_field_that_one_side_lacks():
    """A revision that adds a knob adds its field to every specialisation's name: the builds it leaves alone are still
    compared, by their names without that field; a build whose knob value is the only difference shares its name with
    its twin, so both are listed apart and the old one counts as only in A."""
    a = {"f k=4 M=1": "h1", "f k=4 M=2": "h2", "f k=2 M=1": "h3"}
    b = {"f k=4 M=1 knob=False": "h1", "f k=4 M=2 knob=False": "changed", "f k=2 M=1 knob=False": "h3",
         "f k=2 M=1 knob=True": "h4"}
    equal, differ, only_a, only_b, twins, one_side = P.compare(a, b)
    assert (equal, differ, only_a, only_b) == (["f k=4 M=1"], ["f k=4 M=2"], ["f k=2 M=1"], [])
    assert twins == ["f k=2 M=1 knob=False", "f k=2 M=1 knob=True"] and one_side == ["knob"]
    assert P.compare(a, dict(a)) == (sorted(a), [], [], [], [], [])
    assert P.compare(b, a)[:2] == (["f k=4 M=1 knob=False"], ["f k=4 M=2 knob=False"])     # (a field dropped)
