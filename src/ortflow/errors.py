"""The failures a user can act on: bad input, a bad config, a device or setup that
cannot run. Each is raised with one line (or a list) that names the file, key or
value and says what to do; the CLI and each training rank print that message
without a traceback. Any other exception is a bug and keeps its traceback."""


class OrtflowError(Exception):
    """An expected failure; its message is all the user needs."""


class ConfigError(OrtflowError, ValueError):
    """A configuration value that the schema or a cross-key rule refuses."""


class DataError(OrtflowError, ValueError):
    """Input data that cannot be read or does not fit the config; the message names the file and the problem."""


class CheckpointError(OrtflowError, ValueError):
    """A checkpoint that cannot be read or does not belong to this run; the message names the file."""


class ModelError(OrtflowError, ValueError):
    """A model (built-in, ONNX or exported) that fails a check; the message says which and by how much."""


class DeviceError(OrtflowError, RuntimeError):
    """The configured device or backend cannot run on this machine."""


class PreflightError(OrtflowError, RuntimeError):
    """The setup cannot run training; the message lists each problem with its fix."""


class TrainingError(OrtflowError, RuntimeError):
    """Training cannot go on (a non-finite loss, an injected fault); the message says where."""


class MissingInputError(OrtflowError, FileNotFoundError):
    """A stage's input is not there; the message names the file and the rule that makes it."""
