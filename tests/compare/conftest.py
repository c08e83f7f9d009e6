"""Fixtures shared by the tests of `hf-powernorm compare`."""
import pytest

from hf_powernorm.training import synthetic_lm_corpus, train_bpe_tokenizer


@pytest.fixture(scope="module")
def gpt2_case(tmp_path_factory) -> tuple[str, str, list[str]]:
    """A tiny random GPT-2 (seed 0) saved with a BPE of its corpus, and the corpus as text files: the
    model folder, the task and the data options of a comparison on them."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    corpus = synthetic_lm_corpus({"train": 60, "validation": 12, "test": 12}, seed=5)
    files = {}
    for split, part in corpus.items():
        files[split] = folder / f"{split}.txt"
        files[split].write_text("".join(line + "\n" for line in part["text"]), encoding="utf-8")
    tokenizer = train_bpe_tokenizer(corpus["train"]["text"], vocab_size=120)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=40,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    data = ["--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
            "--test_file", str(files["test"]), "--block_size", "16", "--max_tokens", "64"]
    return str(folder / "model"), "causal-lm", data
