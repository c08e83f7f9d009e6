"""`python recipes/studies/phrasebank_norms.py [options]`: the study `hf_powernorm.studies.phrasebank_norms` (its docstring
says what it runs and writes; also `python -m hf_powernorm.studies phrasebank_norms`)."""

from hf_powernorm.studies.phrasebank_norms import main

if __name__ == "__main__":
    main()
