"""Texts the tests share."""

#: a text to rewrite: its answer repeats the prompt, so prompt-lookup drafts are made and most are right
REPEAT = (
    "Rewrite the following text exactly as it is written.\n\nText: To reset the router, unplug it from the "
    "wall, wait thirty seconds, and plug it back in. When the green light stops blinking, open the settings "
    "page and choose a new password.\n\nRewritten text: "
)
