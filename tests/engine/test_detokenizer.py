from flashpd.engine.detokenizer import Detokenizer, StopState


class _CharTokenizer:
    """Token i decodes to VOCAB[i]; a seam fake for the HF tokenizer."""

    VOCAB = ["Hel", "lo", " wor", "ld", "!", " S", "TOP", " tail"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.VOCAB[i] for i in ids)


def _stream(ids, stop):
    d, st, pieces = Detokenizer(_CharTokenizer()), StopState(stop=stop), []
    for n in range(1, len(ids) + 1):
        pieces.append(d.step(st, ids[:n]))
        if st.stopped:
            break
    else:
        pieces.append(d.flush(st, ids))
    return "".join(pieces), st


def test_stop_string_cut_exactly_and_never_streamed():
    text, st = _stream([0, 1, 2, 3, 5, 6, 7], stop=(" STOP",))
    assert st.stopped and text == "Hello world"


def test_stop_string_spanning_tokens():
    text, st = _stream([0, 1, 2, 3], stop=("lo wo",))
    assert st.stopped and text == "Hel"


def test_no_stop_releases_everything_at_flush():
    text, st = _stream([0, 1, 2, 3, 4], stop=("world!!",))
    assert not st.stopped and text == "Hello world!"
