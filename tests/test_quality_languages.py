"""A minority language in Latin letters is not garbage (data/quality.py's latin_language): with a
tokenizer trained on another language its pages pack like garbage, and were flagged and left out."""

import json
import random
import string

import numpy as np

from test_quality import clean_documents, garbage
from trimtab.data import quality
from trimtab.data.prepare import Options, prepare
from trimtab.data.sources import Document
from trimtab.data.tokenizer import train_tokenizer

VIETNAMESE = (
    "Làng tôi nằm ven một con sông nhỏ, quanh năm nước chảy hiền hòa. Mỗi sáng, tiếng gà gáy và tiếng "
    "mõ chùa đánh thức cả xóm. Người lớn ra đồng cấy lúa, còn trẻ con thì cắp sách đến trường. Chiều về, "
    "khói bếp bay lên từ những mái nhà tranh, mùi cơm mới thơm khắp ngõ. Tôi đã đi xa nhiều năm nhưng vẫn "
    "nhớ từng gốc cây, từng bờ ruộng nơi mình lớn lên."
)
POLISH = (
    "Nasza wieś leży nad niewielką rzeką, która latem prawie wysycha. Rano słychać koguty i dzwony z "
    "pobliskiego kościoła. Dorośli idą do pracy w polu, a dzieci biegną do szkoły przez łąkę. Wieczorem "
    "z kominów unosi się dym i w całej okolicy pachnie świeżym chlebem. Choć mieszkam teraz w mieście, "
    "często wracam myślami do tamtych spokojnych dni."
)
TURKISH = (
    "Köyümüz küçük bir derenin kenarında kurulmuştur ve yazın dere neredeyse kurur. Sabahları horozların "
    "ötüşü ve camiden yükselen ezan sesiyle uyanırız. Büyükler tarlaya çalışmaya gider, çocuklar ise "
    "çayırın içinden koşarak okula yetişir. Akşam olunca bacalardan duman yükselir ve bütün sokak taze "
    "ekmek kokar. Şimdi şehirde yaşasam da o sakin günleri sık sık özlüyorum."
)
CZECH = (
    "Naše vesnice leží u malé říčky, která v létě téměř vysychá. Ráno nás budí kohouti a zvony z "
    "nedalekého kostela. Dospělí chodí pracovat na pole a děti běží do školy přes louku. Večer stoupá z "
    "komínů kouř a celou ulicí voní čerstvý chléb. I když teď bydlím ve městě, často na ty klidné dny vzpomínám."
)
LANGUAGES = (VIETNAMESE, POLISH, TURKISH, CZECH)
# letters at English frequencies (etaoin...): right vowel share and word lengths, no order
ENGLISH_LETTERS = "".join(c * n for c, n in zip("etaoinshr", (13, 9, 8, 8, 7, 7, 6, 6, 6))) + "dlcumwfgypbvk"


def random_words(n: int, letters: str, rng: random.Random) -> str:
    """~n characters of words of 2-9 letters drawn independently from `letters`."""
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(n // 6)]
    return " ".join(words)


def latin_garbage(rng: random.Random) -> list[str]:
    """Garbage in Latin letters: random words (uniform, English frequencies, accented letters),
    base64, hex, printable noise, and the four pages mis-encoded (UTF-8 read as cp1252 / Latin-1)."""
    accented = "".join(chr(c) for c in range(0xC0, 0x250) if chr(c).isalpha())
    made = [random_words(600, letters, rng) for letters in (string.ascii_lowercase, ENGLISH_LETTERS, accented)]
    made += [garbage(kind, 600, rng) for kind in ("printable", "base64", "hexdump")]
    return made + [text.encode().decode(code, errors="replace") for text in LANGUAGES for code in ("cp1252", "latin-1")]


def test_a_latin_script_language_is_spared_and_latin_garbage_is_not():
    """Flagged pages of Vietnamese, Polish, Turkish and Czech were kept flagged (only another script
    was spared); garbage made of the same letters, or of these very pages mis-encoded, stays flagged."""
    bad = latin_garbage(random.Random(0))
    texts = [*LANGUAGES, *bad]
    kept, spared = quality.spare_scripts(np.ones(len(texts), dtype=bool), lambda i: texts[i])
    assert list(spared) == list(range(len(LANGUAGES))) and not kept[: len(LANGUAGES)].any()
    assert set(spared.values()) == {"Latin letters"}
    assert kept[len(LANGUAGES) :].all(), [t[:40] for t, k in zip(bad, kept[len(LANGUAGES) :]) if not k]


def test_prepare_with_a_tokenizer_of_another_language_keeps_the_minority_pages(tmp_path):
    """The four pages with a BPE trained on the crawl's English and code pack at 0.48-0.54x its
    median (the threshold 0.69x): all four were left out with --garbage-filter drop."""
    clean, rng = clean_documents(), random.Random(0)
    english = tmp_path / "tokenizer.json"
    train_tokenizer([Document([(doc, True)]) for doc in clean], 1024).save(english)
    bad = [garbage(kind, 1500, rng) for kind in ("printable", "base64", "hexdump", "mojibake")]
    texts = clean + bad + list(LANGUAGES)
    (tmp_path / "crawl.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    options = Options(garbage_filter="drop")
    manifest = prepare([str(tmp_path / "crawl.jsonl")], tmp_path / "p", tokenizer=str(english), options=options)
    assert manifest["files"][0]["garbage"] == len(bad)  # the garbage, and none of the four pages
    assert manifest["documents"] == len(clean) + len(LANGUAGES)
