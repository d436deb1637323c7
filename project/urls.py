from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from fanout.prometheus import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("django-rq/", include("django_rq.urls")),
    path("fanout/metrics", metrics_view, name="fanout-metrics"),
    path("", RedirectView.as_view(url="admin/", permanent=False)),
]
