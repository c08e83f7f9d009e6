"""The studies: one module per figure or table of the seed documents, on the training library
(`hf_powernorm.training`: its tasks, `grid` of cells that run once, resume and run in parallel,
`reports` of table cells, paired verdicts and CSV files) and their own library here - `runs` (the
studies' language model: its data options, size and grid) and `measures` (what a run's training
log shows).

    python -m hf_powernorm.studies --help            # the studies
    python -m hf_powernorm.studies warmup_switch --smoke --output_dir /tmp/s

Importing this package imports no study: `STUDIES` names them, `__main__` loads the one asked for.
"""

# Each study's module and what it answers (its docstring says how, and STUDIES.md what it found).
STUDIES = {
    "batch_size": "the statistics' mini-batch at a fixed update size (the paper's Figure 5, PTB)",
    "batch_statistics": "why batch normalization fails in transformers (the paper's Figures 2, 3, 4, 6, 7)",
    "convergence": "LayerNorm against PN on PTB trained until validation stops improving (protocol 3)",
    "converted_models": "LayerNorm against PN in Transformers' own models, converted with convert_norms",
    "long_run": "PN over thousands of updates, with and without group scaling, in fp32 and bf16",
    "norm_comparison": "every norm at the same budget (the paper's Tables 1, 2 and B.3: PTB, Multi30k)",
    "phrasebank_norms": "LayerNorm, BatchNorm and no norm in a post-norm encoder on Financial PhraseBank",
    "pn_ablation": "what PN's options do at the same budget, on PTB",
    "tuned_comparison": "LayerNorm, PN and RMSNorm, each tuned alike, in the paper's regime (PTB, Multi30k)",
    "warmup_switch": "PN's switch from the batch statistic to the running one, on PTB",
}

__all__ = ["STUDIES"]
