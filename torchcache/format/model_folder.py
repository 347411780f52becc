"""Files read from a model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja...):
the one rule for where a link in such a folder may lead.

A model folder is data someone else made (downloaded, copied, unpacked). A link in it is followed
only when it stays inside the folder, or, for a Hugging Face cache snapshot
(`.../models--ORG--NAME/snapshots/<revision>/`, whose files are links to `../../blobs/<hash>`),
inside that model's cache folder (`models--ORG--NAME/`). A link that leads anywhere else (a
`chat_template.jinja` pointing at /etc/passwd would put that file into every document and the
cache's spec) is refused with an error naming the link and its target.
"""

from __future__ import annotations

import os

HF_CACHE_PREFIX = "models--"  # a Hugging Face hub cache: models--ORG--NAME/snapshots/<rev>/


def model_file_path(folder: str | os.PathLike, name: str) -> str | None:
    """The path of file `name` of model folder `folder`, checked; None when there is no such file.

    The folder itself is the caller's choice (it may be a link); what is inside it is not: a file
    that is a link (or reached through one) must resolve inside `allowed_root(folder)`, and must be
    a regular file. ValueError naming the link otherwise.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    root = allowed_root(folder)
    target = os.path.realpath(path)
    if not _inside(target, root):
        raise ValueError(f"{path} is a link to {target}, outside the model folder {root}: files "
                         "of a model folder are read only when they (and the links to them) stay "
                         "inside it (or inside the models--*/ folder of a Hugging Face cache "
                         "snapshot); copy the file into the folder, or pass it explicitly")
    if not os.path.exists(target):
        raise FileNotFoundError(f"{path} is a link to {target}, which does not exist; restore it "
                                "or remove the link")
    if not os.path.isfile(target):
        raise ValueError(f"{path} is not a regular file (it resolves to {target}); a model "
                         "folder's files must be regular files")
    return path


def read_model_file(folder: str | os.PathLike, name: str) -> bytes | None:
    """The bytes of file `name` of model folder `folder` (see model_file_path); None when absent."""
    path = model_file_path(folder, name)
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def allowed_root(folder: str | os.PathLike) -> str:
    """Where links in `folder` may lead: the folder (resolved), or, for a Hugging Face cache
    snapshot `models--*/snapshots/<rev>`, the `models--*` folder that holds its blobs."""
    real = os.path.realpath(os.fspath(folder))
    snapshots = os.path.dirname(real)
    model = os.path.dirname(snapshots)
    if (os.path.basename(snapshots) == "snapshots"
            and os.path.basename(model).startswith(HF_CACHE_PREFIX)):
        return model
    return real


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
