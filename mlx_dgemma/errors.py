"""Every error this package raises for bad input or a failed run, in one place. Each is a one-line
message that says what is wrong and how to fix it; the CLIs print it and exit non-zero.

``DGemmaError`` (a ``ValueError``) is the base of them all, so ``except DGemmaError`` catches what
the package refuses and nothing else; ``OptionError`` is an option's value or combination;
``MissingExtra`` (an ``ImportError``) a feature whose optional dependencies are not installed."""


class DGemmaError(ValueError):
    """Bad input or a run that cannot go on; the message says what is wrong and how to fix it."""


class MissingExtra(ImportError):
    """A feature whose extra is not installed: names the missing module and the pip command. ``package``
    is the module that cannot be imported without it (what ``python -m`` reports)."""

    def __init__(self, module: str | None, feature: str, extra: str, package: str | None = None):
        missing = f"{module.split('.')[0]} is not installed" if module else "a dependency is missing"
        super().__init__(
            f"{missing}; {feature} needs the {extra} extra: pip install 'mlx-dgemma[{extra}]'", name=package
        )


class TokenizerError(DGemmaError):
    """Text given where the checkpoint has no tokenizer, or tokenizer files that cannot be read."""


class ConfigError(DGemmaError):
    """A config file that cannot describe a DiffusionGemma text model."""


class CheckpointError(DGemmaError):
    """A checkpoint that cannot be loaded; the message says what is wrong and names the file or key."""


class ImageError(DGemmaError):
    """An image that cannot be used; the message names it and says why."""


class VideoError(ImageError):
    """A video that cannot be used (its frames go where images go); the message names it and says why."""


class PromptError(DGemmaError):
    """A prompt the model cannot take; ``option`` names the option at fault where it is not the prompt
    (``max_tokens``), ``context`` says the prompt and answer are past the model's context."""

    def __init__(self, message: str, option: str | None = None, context: bool = False):
        super().__init__(message)
        self.option, self.context = option, context


class OptionError(DGemmaError):
    """Options that cannot go together; ``option`` names the one at fault (a server's 400 names it)."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


class DataError(DGemmaError):
    """Training data that cannot be used; the message names the file and line."""


class FineTuneError(DGemmaError):
    """A fine-tuning request that cannot be carried out; the message says why."""


class ConversionError(DGemmaError):
    """A conversion that cannot be done as asked; the message says why in one line."""


class MemoryCheckError(DGemmaError):
    """A model that needs more memory than the device can give; the message says what would fit."""


class DistributedError(DGemmaError, RuntimeError):
    """A rank that cannot go on: its peers are gone, or it holds a different checkpoint."""


class TemplateError(DGemmaError):
    """A template or schema that cannot be built; the message names the place. ``option`` names the
    option at fault where it is not the template (``max_tokens``), ``context`` says the template runs
    past the model's context."""

    def __init__(self, message: str, option: str | None = None, context: bool = False):
        super().__init__(message)
        self.option, self.context = option, context
