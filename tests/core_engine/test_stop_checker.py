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
    assert other.flush().text == ""


def test_flush_releases_held_back_text_when_the_request_ends_otherwise() -> None:
    checker = StopChecker(["###"])
    assert checker.append("done #") == "done "
    assert checker.flush().text == "#"
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
    assert checker.flush().text == ""


def test_unicode_stop_string() -> None:
    checker = StopChecker(["🙂"])
    assert feed(checker, ["héllo ", "🙂", " bye"]) == "héllo "


def test_payloads_go_out_with_the_first_character_of_their_text() -> None:
    checker: StopChecker[int] = StopChecker(["END"])
    first = checker.push("the E", 1)
    assert (first.text, first.payloads, first.stopped) == ("the ", [1], False)
    second = checker.push("N", 2)
    assert (second.text, second.payloads) == ("", [])  # "EN" may still become the stop
    third = checker.push("D and more", 3)
    # The stop cut everything after "the ": tokens 2 and 3 showed nothing and are dropped.
    assert (third.text, third.payloads, third.stopped) == ("", [], True)
    assert checker.push("x", 4).stopped and checker.flush().text == ""


def test_a_false_alarm_releases_the_held_payloads_with_their_text() -> None:
    checker: StopChecker[int] = StopChecker(["END"])
    checker.push("E", 1)
    released = checker.push("ARLY", 2)
    assert (released.text, released.payloads) == ("EARLY", [1, 2])
    tail = StopChecker[int](["!!"])
    tail.push("hi!", 7)
    flushed = tail.flush()
    assert (flushed.text, flushed.payloads, flushed.stopped) == ("!", [], False)
