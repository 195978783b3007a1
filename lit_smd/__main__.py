"""``python -m lit_smd`` is the ``lit-smd`` command."""

from lit_smd.console import console_main

if __name__ == "__main__":
    console_main()
