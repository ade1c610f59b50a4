from __future__ import annotations

from core_engine.stop_checker import StopChecker


def feed(checker: StopChecker, deltas: list[str]) -> str:
    return "".join(checker.append(d) for d in deltas)


def test_stop_string_split_across_tokens_is_found_and_not_leaked() -> None:
    checker = StopChecker(["\n\nUser:"])
    shown = [checker.append(d) for d in ["Hello", " there", "\n", "\nUs", "er:", " more"]]
    assert "".join(shown) == "Hello there"
    assert checker.matched == "\n\nUser:"
    # Nothing of the stop string was ever shown, even while it was incomplete.
    assert shown[2] == "" and shown[3] == ""


def test_false_alarm_is_released_once_it_cannot_match() -> None:
    checker = StopChecker(["END"])
    assert checker.append("the EN") == "the "
    assert checker.append("D? no: ENTRY") == ""
    assert checker.matched == "END"
    other = StopChecker(["END"])
    assert other.append("the EN") == "the "
    assert other.append("TRY") == "ENTRY"
    assert other.flush() == ""


def test_flush_releases_held_back_text_when_the_request_ends_otherwise() -> None:
    checker = StopChecker(["###"])
    assert checker.append("done #") == "done "
    assert checker.flush() == "#"
    assert checker.matched is None


def test_earliest_of_several_stop_strings_wins() -> None:
    checker = StopChecker(["world", "lo w"])
    assert feed(checker, ["hello world"]) == "hel"
    assert checker.matched == "lo w"


def test_include_stop_str_in_output() -> None:
    checker = StopChecker(["</s>"], include_stop_str_in_output=True)
    assert feed(checker, ["answer</", "s> trailing"]) == "answer</s>"


def test_no_stop_strings_passes_text_through() -> None:
    checker = StopChecker([])
    assert checker.append("abc") == "abc"
    assert checker.flush() == ""


def test_unicode_stop_string() -> None:
    checker = StopChecker(["🙂"])
    assert feed(checker, ["héllo ", "🙂", " bye"]) == "héllo "
