from flashpd.engine.detokenizer import TextStream


class _CharTokenizer:
    """Token i decodes to VOCAB[i]; a seam fake for the HF tokenizer."""

    VOCAB = ["Hel", "lo", " wor", "ld", "!", " S", "TOP", " tail"]

    def decode(self, ids):
        return "".join(self.VOCAB[i] for i in ids)


def _stream(ids, stop):
    stream, pieces = TextStream(_CharTokenizer(), stop), []
    for t in ids:
        pieces.append(stream.push(t))
        if stream.stopped:
            break
    else:
        pieces.append(stream.flush())
    return "".join(pieces), stream


def test_stop_string_cut_exactly_and_never_streamed():
    text, stream = _stream([0, 1, 2, 3, 5, 6, 7], stop=(" STOP",))
    assert stream.stopped and text == "Hello world"


def test_stop_string_spanning_tokens():
    text, stream = _stream([0, 1, 2, 3], stop=("lo wo",))
    assert stream.stopped and text == "Hel"


def test_no_stop_releases_everything_at_flush():
    text, stream = _stream([0, 1, 2, 3, 4], stop=("world!!",))
    assert not stream.stopped and text == "Hello world!"
