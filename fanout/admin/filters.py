"""The item list's filters: a django-filter FilterSet, shown in the admin's sidebar.

The FilterSet parses and validates the query string and builds the query; FilterSetListFilter
adapts it to the admin's list-filter protocol, so the admin's "clear all filters", preserved
filters and pagination keep working.
"""

from __future__ import annotations

from typing import Any

import django_filters
from django import forms
from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db.models import QuerySet
from django_filters.widgets import DateRangeWidget, RangeWidget, SuffixedMultiWidget

from ..clock import db_now
from ..models import CapacityPool, ItemClaim, ItemStatus
from ..waiting import held_q

# "held" (pending items held back) is the progress bar's "waiting" segment; the status
# "waiting" is an item whose work a child run does.
HELD = "held"
STATUS_CHOICES = [
    *ItemStatus.choices[:1],
    (HELD, "Held back (pending)"),
    *[
        (value, "Waiting on a child run" if value == ItemStatus.WAITING else label)
        for value, label in ItemStatus.choices[1:]
    ],
]


class _NumberRangeWidget(RangeWidget):
    def __init__(self, attrs: dict[str, Any] | None = None) -> None:
        inputs = (
            forms.NumberInput(attrs={"min": 1, "placeholder": "from"}),
            forms.NumberInput(attrs={"min": 1, "placeholder": "to"}),
        )
        SuffixedMultiWidget.__init__(self, inputs, attrs)


class _DateTimeInput(forms.DateTimeInput):
    input_type = "datetime-local"

    def __init__(self) -> None:
        super().__init__(format="%Y-%m-%dT%H:%M")


class _DateTimeRangeWidget(DateRangeWidget):
    def __init__(self, attrs: dict[str, Any] | None = None) -> None:
        SuffixedMultiWidget.__init__(self, (_DateTimeInput(), _DateTimeInput()), attrs)


def _pool_choices() -> list[tuple[str, str]]:
    return [(name, name) for name in CapacityPool.objects.values_list("name", flat=True)]


class ItemClaimFilterSet(django_filters.FilterSet):
    run = django_filters.NumberFilter(
        field_name="run_id", label="Run id", widget=forms.NumberInput(attrs={"min": 1})
    )
    status = django_filters.ChoiceFilter(
        label="status", choices=STATUS_CHOICES, method="filter_status"
    )
    pool = django_filters.ChoiceFilter(label="pool", choices=_pool_choices)
    error_class = django_filters.CharFilter(label="Error class")
    attempt = django_filters.RangeFilter(label="Attempts", widget=_NumberRangeWidget)
    owner = django_filters.CharFilter(label="Lease holder", lookup_expr="icontains")
    finished = django_filters.IsoDateTimeFromToRangeFilter(
        field_name="finished_at", label="Finished between", widget=_DateTimeRangeWidget
    )

    class Meta:
        model = ItemClaim
        fields: list[str] = []

    def filter_status(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        if value == HELD:
            return queryset.filter(held_q(db_now()))
        return queryset.filter(status=value)


class FilterSetListFilter(admin.ListFilter):
    """An admin list filter that takes its parameters, validation and query from a FilterSet.

    Choice filters render as the admin's usual links; the others share one small GET form.
    """

    filterset_class: type[django_filters.FilterSet]
    title = "value"
    template = "fanout/admin/filterset_filter.html"

    def __init__(
        self, request: Any, params: dict[str, list[str]], model: Any, model_admin: Any
    ) -> None:
        super().__init__(request, params, model, model_admin)
        for name in self.expected_parameters():
            if name in params:
                self.used_parameters[name] = params.pop(name)[-1]
        self.filterset = self.filterset_class(
            self.used_parameters or None, queryset=model._default_manager.all(), request=request
        )

    @classmethod
    def field_parameters(cls) -> dict[str, list[str]]:
        """Each filter's query-string parameters (a range has two: name_min, name_max)."""
        out = {}
        for name, f in cls.filterset_class.base_filters.items():
            widget = f.field.widget
            if isinstance(widget, SuffixedMultiWidget):
                out[name] = [widget.suffixed(name, s) for s in widget.suffixes]
            else:
                out[name] = [name]
        return out

    def expected_parameters(self) -> list[str | None]:
        return [p for params in self.field_parameters().values() for p in params]

    def has_output(self) -> bool:
        return True

    def queryset(self, request: Any, queryset: QuerySet) -> QuerySet:
        if not self.used_parameters:
            return queryset
        if not self.filterset.is_valid():
            raise IncorrectLookupParameters(self.filterset.errors.as_text())
        return self.filterset.filter_queryset(queryset)

    def choices(self, changelist: Any) -> Any:
        """A list of links per choice filter, then one form with the other filters."""
        form = self.filterset.form
        inputs = []
        for name, f in self.filterset_class.base_filters.items():
            if isinstance(f, django_filters.ChoiceFilter):
                links = self._links(changelist, name, form.fields[name].choices)
                yield {"kind": "links", "title": f.label or name, "links": links}
            else:
                inputs.append(form[name])
        if inputs:
            parameters = self.field_parameters()
            own = {p for f in inputs for p in parameters[f.name]}
            hidden = [
                (key, value)
                for key, values in changelist.filter_params.items()
                if key not in own
                for value in values
            ]
            yield {"kind": "form", "title": "more filters", "fields": inputs, "hidden": hidden}

    def _links(self, changelist: Any, name: str, choices: Any) -> list[dict[str, Any]]:
        current = self.used_parameters.get(name)
        links = [
            {
                "display": "All",
                "selected": current is None,
                "query_string": changelist.get_query_string(remove=[name]),
            }
        ]
        for value, label in choices:
            if value != "":
                links.append(
                    {
                        "display": label,
                        "selected": current == str(value),
                        "query_string": changelist.get_query_string({name: value}),
                    }
                )
        return links


class ItemClaimFilter(FilterSetListFilter):
    filterset_class = ItemClaimFilterSet
