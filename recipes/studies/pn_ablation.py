"""The study `hf_powernorm.studies.pn_ablation` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies pn_ablation`)."""

from hf_powernorm.studies.pn_ablation import main

if __name__ == "__main__":
    main()
