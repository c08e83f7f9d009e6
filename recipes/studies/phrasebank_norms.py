"""The study `hf_powernorm.studies.phrasebank_norms` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies phrasebank_norms`)."""

from hf_powernorm.studies.phrasebank_norms import main

if __name__ == "__main__":
    main()
