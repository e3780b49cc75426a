"""A user's tool file for the tool-loop recipe (`rollout.tools=[path/to/user_tools.py]`):
each public function with type hints and a docstring is a tool, its schema derived from them."""


def word_count(text: str) -> int:
    """Count the words of a text.

    Args:
        text: the text
    """
    return len(text.split())
