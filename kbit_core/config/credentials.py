"""Recognising credentials by option name and masking them, by name and by value, in text and URLs."""

from __future__ import annotations

import re

_SECRET_OPTION = re.compile(
    r"password|passwd|secret|token|credential|passphrase|private|pem|jaas|(^|[._-])key($|[._-])"
)


def is_secret_option(name: str) -> bool:
    """Whether a client option (or a flattened config key) holds a credential: passwords, tokens, PEM keys, ...

    ``ssl.key.location``-style paths name a file, not the key itself, and stay readable.
    """
    name = name.lower()
    return bool(_SECRET_OPTION.search(name)) and not name.endswith((".location", "_location"))


# key=value pairs inside a value: JAAS (`password="..."`), OAuth (`clientSecret=...`), connection strings.
_CREDENTIAL_PAIR = re.compile(r"""(?P<key>[\w.-]+)(?P<sep>\s*=\s*)(?P<value>"[^"]*"|'[^']*'|[^\s;,&]+)""")


# A URL's user:password@ part.
_URL_PASSWORD = re.compile(r"(?P<prefix>[a-z][\w+.-]*://[^:/@\s]+:)[^@/\s]+@", re.IGNORECASE)


def mask_credentials(text: str) -> str:
    """``text`` with every credential inside it replaced by '***': the value of each key=value pair whose key is
    credential-like (``sasl.oauthbearer.config``'s ``clientSecret=...``, a JAAS ``password="..."``) and a URL's
    password. An option's name alone does not reveal such a value (see :func:`is_secret_option`)."""

    def pair(match: re.Match[str]) -> str:
        return f"{match['key']}{match['sep']}***" if is_secret_option(match["key"]) else match[0]

    return _URL_PASSWORD.sub(r"\g<prefix>***@", _CREDENTIAL_PAIR.sub(pair, text))


def _holds_credential(option: str, value: str) -> bool:
    return is_secret_option(option) or mask_credentials(value) != value
