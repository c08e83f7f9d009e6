"""The study `hf_powernorm.studies.warmup_switch` as a script: its docstring says what it runs and
writes (also `python -m hf_powernorm.studies warmup_switch`)."""

from hf_powernorm.studies.warmup_switch import main

if __name__ == "__main__":
    main()
