"""A deterministic corpus of hard strings for comparing tokenizers (same strings every run).

corpus() gives ~2,600 strings: hand-picked edge cases, then seeded random mixes of many
scripts, emoji, combining marks, whitespace runs, numbers, code, contractions and the text
of special tokens. Strings are Python str (no lone surrogates), so they survive JSON lines.
"""
import random

SPECIAL_TEXTS = ["<|begin_of_text|>", "<|end_of_text|>", "<|endoftext|>", "<s>", "</s>", "<unk>",
                 "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|fim_prefix|>",
                 "<|endofprompt|>", "<|eot_id|>", "<|reserved_special_token_5|>", "<0x0A>", "<mask>",
                 "[MASK]", "<|start_header_id|>", "<|endoftext|", "<|user|>", "<|end|>", "<start_of_turn>",
                 "<end_of_turn>", "<bos>", "<eos>"]

WORDS = {
    "latin": ["hello", "World", "naïve", "café", "façade", "über", "Straße", "déjà", "vu", "jalapeño",
              "smörgåsbord", "Ærø", "œuvre", "İstanbul", "ǅemal", "ﬁne", "ŉ", "résumé", "coöperate"],
    "cyrillic": ["привет", "мир", "Ёлка", "щука", "Україна", "ґанок", "Српски", "Љубав"],
    "greek": ["γειά", "σου", "κόσμε", "Ελληνικά", "ΑΘΗΝΑ", "ϐ", "ς"],
    "arabic": ["مرحبا", "بالعالم", "العَرَبِيَّة", "٣٤٥", "ﷺ", "لا"],
    "hebrew": ["שלום", "עולם", "עִבְרִית", "בְּרֵאשִׁית"],
    "devanagari": ["नमस्ते", "दुनिया", "हिन्दी", "क्षत्रिय", "१२३"],
    "thai": ["สวัสดี", "ชาวโลก", "ภาษาไทย", "กรุงเทพมหานคร"],
    "cjk": ["你好", "世界", "漢字", "日本語", "東京都", "ｶﾀｶﾅ", "ひらがな", "中华人民共和国", "豈", "𠮷野家"],
    "hangul": ["안녕하세요", "세계", "한국어", "\u1100\u1161\u11a8", "\u110b\u1167\u11bc"],
    "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "❤️", "🧑🏿‍💻", "🤷‍♀️", "☕", "🫠", "1️⃣", "👁‍🗨"],
    "marks": ["e\u0301", "a\u0308\u0301", "n\u0303", "o\u0328\u0304", "\u0301", "A\u030a", "ร\u0e31",
              "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319", "q\u0323\u0307", "\u1e0b\u0323"],
    "rare": ["\ufffd", "\ue000", "\U000f0000", "\u180e", "\u200b", "\u200d", "\ufeff", "\u00ad", "\u2028",
             "\u2029", "\u0085", "\u00a0", "\u3000", "\u202f", "\U0001d400", "\U0001f9ff", "\u0000",
             "\u001f", "\u007f", "\u212b", "\u2126", "\u212a", "ſ", "\uf900", "\U0002f800", "\u0958"],
    "code": ["def f(x):", "return x**2", "int main() {", "}", "std::vector<int>", "if (a && b) {",
             "for i in range(10):", "console.log('hi');", "<div class=\"x\">", "SELECT * FROM t;",
             "x += 1;", "#include <stdio.h>", "`code`", "$HOME/.bashrc", "a->b", "0x1F", "1e-9",
             "https://example.com/a?b=c&d=e", "user@example.org", "{\"key\": [1, 2.5, null]}"],
    "punct": ["!!!", "?!", "...", "—", "–", "«»", "“quoted”", "‘", "¿", "¡", "...?!", "***", "---", "::",
              "()", "[]", "{}", "@#$%^&*", "、", "。", "！", "？", "・", "…"],
    "numbers": ["0", "7", "42", "123", "1234", "12345", "3.14159", "1,000,000", "2024-05-06",
                "12345678901234567890", "٠١٢٣", "１２３", "Ⅻ", "½", "²", "⁴²"],
    "contractions": ["it's", "IT'S", "don't", "DON'T", "we're", "WE'RE", "I've", "I'VE", "I'm",
                     "I'M", "you'll", "YOU'LL", "he'd", "HE'D", "'s", "'T", "'Re", "'vE", "'ſ",
                     "o'clock", "rock'n'roll", "’s", "''"],
}

SPACES = [" ", " ", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\n ", "\r", "\u00a0",
          "\u3000", "\t\t", "    ", "\n\n\n", " \t \n", "\u2028", "\u0085", "\u180e", ""]

EDGE_CASES = [
    "", " ", "  ", "   ", "\n", "\n\n", "\r\n", "\r", "\t", " \t\n\r\n ", "a", "A", "ab", "abc",
    "Hello world", " Hello world", "Hello world ", "  Hello   world  ", "Hello\nworld", "Hello\r\nworld",
    "hello\n\n\nworld", "trailing spaces   ", "   leading spaces", "\n leading newline", "tabs\tand\tmore",
    "The quick brown fox jumps over the lazy dog.", "I'm sure it's what we've said you'll do, he'd say.",
    "I'M SURE IT'S WHAT WE'VE SAID YOU'LL DO, HE'D SAY.", "'s't're've'm'll'd", "'S'T'RE'VE'M'LL'D",
    "<|begin_of_text|>Hello<|end_of_text|>", "<s>Hello</s>", "<s> Hello </s>", " <s>", "<s> ", "<s><s></s>",
    "text<|endoftext|>text", "<|endoftext|><|endoftext|>", "<|endoftext|", "<|im_start|>user\nHi<|im_end|>\n",
    "<think>\nreasoning\n</think>\n\nanswer", "<|user|>\nHi<|end|>\n<|assistant|>\n  Hello<|end|>  \n<|endoftext|>",
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n Hello<end_of_turn>\n", "a<unk>b", "<0x0A>", "▁", "▁▁hello", "Ġ", "Ċ",
    "12345678901234567890123456789012345678901234567890", "3.14159265358979323846264338327950288419716939937510",
    "1 22 333 4444 55555 666666", "x" * 3000, "ab" * 1000, "supercalifragilisticexpialidocious" * 30,
    " " * 2000, "\n" * 300, "\t" * 100, " \n" * 200, "!" * 500, "😀" * 200, "你好" * 300, "é" * 400,
    "e\u0301" * 100, "\u0301" * 50, "a" + "\u0301" * 30, "\ufffd\ufffd", "\ue000\ue001\uf8ff",
    "\U0010fffd", "\u0000", "a\u0000b", "\u180e\u180e", "x\u180ey", "\u0085\u0085", "\u2028x\u2029",
    "👨‍👩‍👧‍👦👍🏿🏳️‍🌈", "Ǆǅǆ", "ﬃ", "Å", "\u212b", "\u1e9b\u0323", "\u0344", "\u0f73", "\u2adc",
    "\uac00\u11a8", "\u1100\u1161", "\u1100\u1161\u11a8", "\uac00\u1161", "\U0001d15e", "\U000110ab",
    "def main():\n    print('hello')\n    return 0\n",
    "#include <iostream>\nint main() { std::cout << \"hi\\n\"; }\n",
    "{\n  \"a\": [1, 2, 3],\n  \"b\": null\n}", "<html><body><p>Hi &amp; bye</p></body></html>",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;", "```python\nx = 1\n```",
    "- item 1\n- item 2\n  - nested", "| a | b |\n|---|---|\n| 1 | 2 |", "C:\\Users\\me\\file.txt",
    "https://huggingface.co/docs/tokenizers?x=1#y", "@user #hashtag $100 50% 3*4=12",
    "My name is Anthony ony", "a [MASK] b", "x  <mask>  y", "worldwide world world!", "say hello  hello",
    "éé café", "Привет, мир! Как дела?", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
    "สวัสดีชาวโลก", "你好，世界！", "こんにちは世界", "안녕하세요 세계", "Ṁüłţï-şçŗïþţ ţêẋţ",
]


def random_string(rng):
    kinds = list(WORDS)
    parts = []
    for _ in range(rng.randint(1, 24)):
        r = rng.random()
        if r < 0.08:
            parts.append(rng.choice(SPECIAL_TEXTS))
        elif r < 0.12:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 25))))
        elif r < 0.15:
            parts.append("".join(chr(rng.choice(_CODE_POINTS)) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(rng.choice(WORDS[rng.choice(kinds)]))
        parts.append(rng.choice(SPACES))
    s = "".join(parts)
    if rng.random() < 0.3:
        s = rng.choice(SPACES) + s
    if rng.random() < 0.3:
        s = s.rstrip(" ")
    return s


# Code points for "soup" fragments: every block has a few, surrogates excluded.
_CODE_POINTS = [cp for cp in list(range(0x20, 0x3000, 7)) + list(range(0x3000, 0x10000, 97))
                + list(range(0x10000, 0x110000, 3001)) if not 0xD800 <= cp < 0xE000]


def corpus(n_random=2400, seed=20240607):
    rng = random.Random(seed)
    out = list(EDGE_CASES)
    for kind, words in WORDS.items():
        out.append(" ".join(words))
        out.append("".join(words))
    out += [random_string(rng) for _ in range(n_random)]
    return out


def all_code_points():
    """Every code point (no surrogates) next to combining marks and jamo, 192 to a string."""
    marks = ["", "\u0301", "\u0316", "\u0308\u0301", "\u0327", "\u1161", "\u11a8", "\u0334", "\u05b0"]
    out, chunk = [], []
    for i, cp in enumerate(cp for cp in range(0x110000) if not 0xD800 <= cp < 0xE000):
        chunk.append(chr(cp) + marks[i % len(marks)])
        if len(chunk) == 192:
            out.append("".join(chunk))
            chunk = []
    out.append("".join(chunk))
    return out


if __name__ == "__main__":
    import json
    for s in corpus():
        print(json.dumps(s))
