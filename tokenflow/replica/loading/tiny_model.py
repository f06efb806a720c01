"""The embedded default model `tokenflow-tiny`: a small Llama config and a byte-level BPE tokenizer.

No weights are shipped: the loader builds them with `load_format="dummy"`. This module only
builds the packaged assets (`python -m tokenflow.replica.loading.tiny_model`); the runtime finds them
through `model_source`. The tokenizer is trained here, deterministically, on text generated in code, so `build_tiny_assets` rewrites the
packaged files byte for byte (a test checks it) and nothing is ever downloaded.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tokenflow.replica.loading.model_source import tiny_model_dir

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN]
TARGET_VOCAB_SIZE = 3072

# Llama-3 style: every turn is a header plus content closed by <|eot_id|>; the BOS comes from
# the template, so a rendered chat is encoded with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

def _phrases(text: str) -> list[str]:
    return text.split(",")


_PARAGRAPHS = [
    "A serving engine turns requests into tokens. Each step the scheduler picks which requests "
    "run, how many tokens each may compute, and which blocks of the key and value cache they "
    "use. The model runner builds one flat batch, runs the forward pass, and samples the next "
    "token for every request whose prompt is complete.",
    "The river ran quietly past the old mill, where children once watched the wheel turn from "
    "morning until evening. In the summer the water was low and warm; in the winter it froze at "
    "the edges, and the village gathered on the bridge to watch the ice break in the spring.",
    "To bake a simple loaf of bread, mix four cups of flour with a spoon of salt, a little yeast "
    "and warm water. Knead the dough for ten minutes, let it rise for an hour, shape it, and bake "
    "it in a hot oven until the crust is golden and the bottom sounds hollow when tapped.",
    "Light travels about three hundred thousand kilometers every second. The sun is roughly eight "
    "light minutes away from the earth, while the nearest star beyond it is more than four light "
    "years away. Astronomers measure these distances with parallax, radar and careful models.",
    "The library opened at nine o'clock. Students carried laptops, notebooks and coffee to the "
    "long wooden tables, and the reading room filled with the soft sound of pages turning, keys "
    "tapping and the occasional whisper between friends preparing for their final examinations.",
    "Good software is written for the next person who reads it. Short functions, clear names and "
    "tests that run in seconds make a system easy to change. When a design document and the code "
    "disagree, one of them is wrong, and the fix belongs in the same change.",
    "In the market, traders sold apples, pears, oranges, grapes, lemons, tomatoes, potatoes, "
    "onions, carrots, beans, rice, cheese, fish and fresh herbs. Prices were written in chalk on "
    "small boards, and every seller claimed to have the best fruit in the whole city.",
    "History remembers kings and battles, but most people spent their lives farming, building, "
    "trading, teaching and raising families. Letters, diaries and account books tell us how they "
    "worked, what they ate, what they feared and what they hoped for their children.",
    "The weather today is cloudy with a chance of rain in the afternoon. Temperatures will reach "
    "eighteen degrees, with light winds from the west. Tomorrow should be brighter and warmer, "
    "although a storm may arrive on Friday evening along the northern coast.",
    "Mathematics studies numbers, shapes, patterns and change. A prime number has exactly two "
    "divisors; the sum of the angles of a triangle is one hundred and eighty degrees; and the "
    "derivative of a function describes how quickly its value changes at each point.",
    "Our team meets every Monday to review the plan. We discuss what shipped last week, which "
    "problems are still open, and who needs help. Decisions are written down, questions get an "
    "owner, and the meeting ends on time so that everyone can return to their work.",
    "Doctors and nurses work long shifts at the hospital. They check patients, measure blood "
    "pressure, prescribe medicine and explain treatment plans to worried families. A good clinic "
    "keeps careful records, washes its hands often and never stops learning from its mistakes.",
    "The orchestra tuned their instruments while the audience found their seats. Violins, cellos, "
    "flutes, trumpets and drums filled the concert hall with music; the conductor raised her "
    "baton, and for two hours the symphony carried everyone far away from their ordinary worries.",
    "Football, basketball, tennis, swimming and running are popular sports around the world. "
    "Athletes train for years, practice every morning, follow strict diets and compete in national "
    "championships, hoping one day to win a medal at the international games.",
    "The government announced a new policy on energy, transport and housing. Economists debated "
    "whether taxes, interest rates and public investment would reduce inflation, increase wages "
    "and create jobs, while journalists interviewed citizens about their daily expenses.",
    "Mountains, valleys, forests, deserts, islands, lakes and oceans cover the surface of our "
    "planet. Geologists study rocks and volcanoes, biologists study plants and animals, and "
    "climate scientists collect temperature data from satellites, balloons and ships.",
    "Please remember to lock the office, switch off the lights, water the plants, empty the "
    "kitchen bin, and reply to the customer emails before leaving. Thank you for your patience, "
    "your kindness and your excellent attention to detail during this busy quarter.",
    "The cat slept on the windowsill while the dog waited by the door for its evening walk. Birds "
    "sang in the garden, a neighbor mowed the lawn, and somewhere down the street a radio played "
    "an old song that everyone seemed to know but nobody could name.",
]

_SUBJECTS = _phrases(
    "the engine,a student,my friend,the teacher,our server,the model,a farmer,the city,"
    "this request,the scheduler,a small robot,the old man,her sister,the company,"
    "every worker"
)
_VERBS = _phrases(
    "reads,writes,builds,finds,opens,closes,moves,sends,receives,computes,prints,checks,"
    "loads,saves,returns,starts,stops,waits for,asks about,talks about"
)
_OBJECTS = _phrases(
    "the answer,a long letter,the first token,a new block,the cache,an apple,the door,"
    "a question,the report,the weather,a story,the next step,the final result,"
    "a green house,the budget,the network,a quiet room,the garden"
)
_ENDINGS = _phrases(
    "today,yesterday,again,quickly,slowly,carefully,at noon,in the morning,before dinner,"
    "after the meeting,every day,without a word,with great care,on Monday,in the evening"
)
_WORLD = [
    "Café, naïve, résumé, façade, São Paulo, Zürich, Kraków, Ångström, señor, crème brûlée.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다。",
    "Привет, мир! Γειά σου κόσμε! שלום עולם! مرحبا بالعالم! नमस्ते दुनिया!",
    "Emoji: 😀 🚀 🎉 ❤️ 👍 🌍 — and symbols: © ® ™ € £ ¥ ° ± × ÷ → ∞.",
    "def step(self) -> None:\n    out = self.scheduler.schedule()\n    return self.update(out)\n",
    'print({"id": 42, "ok": true, "items": [1, 2, 3], "name": "tokenflow"})',
]


def _corpus() -> Iterator[str]:
    """The training text: fixed paragraphs and templated sentences from a seeded generator."""
    rng = random.Random(20240601)
    for _ in range(4):
        yield from _PARAGRAPHS
        yield from _WORLD
    for i in range(3000):
        words = [rng.choice(pool) for pool in (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS)]
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice([".", "!", "?", ",", ";"])
        if i % 10 == 0:
            units, price, cents = rng.randint(0, 99999), rng.randint(1, 999), rng.randint(0, 99)
            yield f"Item {i}: {units} units at {price}.{cents:02d} each"


def train_tokenizer() -> HFTokenizer:
    """Train the byte-level BPE tokenizer: special tokens get ids 0-4, then bytes, then merges."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # As Llama 3: encode(add_special_tokens=True) prepends BOS through the post-processor.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _model_config(tok: HFTokenizer) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": tok.token_to_id(BOS_TOKEN),
        # Both end markers stop generation, as in Llama 3.1 Instruct.
        "eos_token_id": [tok.token_to_id(EOS_TOKEN), tok.token_to_id(EOT_TOKEN)],
    }


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }


def _dump_json(obj: object) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def build_tiny_assets(out_dir: str | Path) -> Path:
    """Write config.json, tokenizer.json and tokenizer_config.json to `out_dir`; deterministic."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    files = {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "config.json": _dump_json(_model_config(tok)),
        "tokenizer_config.json": _dump_json(_tokenizer_config()),
    }
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return out


if __name__ == "__main__":
    print(build_tiny_assets(tiny_model_dir()))
