"""The seeded customer directory: fixed demo records, read-only, so every run tells the same story."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Order(BaseModel):
    orderId: str
    placedOn: str = Field(description="ISO date the order was placed.")
    items: list[str]
    total: float
    currency: str
    shipmentStatus: str = Field(description="delivered | in_transit | lost_in_transit | processing")
    carrier: str | None = None
    trackingNumber: str | None = None
    lastTrackingEvent: str | None = Field(default=None, description="The carrier's latest scan, if any.")


class Customer(BaseModel):
    customerId: str
    name: str
    email: str
    phone: str
    tier: str = Field(
        description="Loyalty tier: gold, silver or bronze. Gold customers get priority handling."
    )
    customerSince: str = Field(description="ISO date the account was opened.")
    preferredLanguage: str
    recentOrders: list[Order]
    notes: str = Field(description="Free-text notes from earlier support contacts.")


_CUSTOMERS: tuple[Customer, ...] = (
    Customer(
        customerId="C-42",
        name="Alice Martin",
        email="alice.martin@example.com",
        phone="+33 6 12 34 56 78",
        tier="gold",
        customerSince="2019-03-14",
        preferredLanguage="en",
        recentOrders=[
            Order(
                orderId="5531",
                placedOn="2025-11-18",
                items=["Espresso machine Barista Pro", "Descaling kit"],
                total=489.90,
                currency="EUR",
                shipmentStatus="lost_in_transit",
                carrier="ParcelExpress",
                trackingNumber="PX-88213457-FR",
                lastTrackingEvent=(
                    "2025-11-20 Departed sorting hub Lyon; no scan since. "
                    "Expected delivery 2025-11-22 has passed."
                ),
            ),
            Order(
                orderId="5214",
                placedOn="2025-09-02",
                items=["Milk frother"],
                total=59.00,
                currency="EUR",
                shipmentStatus="delivered",
                carrier="ParcelExpress",
                trackingNumber="PX-87100231-FR",
                lastTrackingEvent="2025-09-04 Delivered, signed by A. Martin.",
            ),
        ],
        notes="Long-standing gold customer. Prefers email. No previous delivery complaints.",
    ),
    Customer(
        customerId="C-7",
        name="Bob Okafor",
        email="bob.okafor@example.com",
        phone="+44 20 7946 0958",
        tier="silver",
        customerSince="2022-06-01",
        preferredLanguage="en",
        recentOrders=[
            Order(
                orderId="5540",
                placedOn="2025-11-25",
                items=["Coffee grinder Burr 60"],
                total=129.00,
                currency="GBP",
                shipmentStatus="processing",
            ),
        ],
        notes="Asked twice about invoice copies; send PDFs by email.",
    ),
    Customer(
        customerId="C-108",
        name="Chiara Rossi",
        email="chiara.rossi@example.com",
        phone="+39 02 1234 5678",
        tier="bronze",
        customerSince="2025-01-10",
        preferredLanguage="it",
        recentOrders=[
            Order(
                orderId="5489",
                placedOn="2025-10-30",
                items=["Travel mug", "Filter papers x200"],
                total=34.50,
                currency="EUR",
                shipmentStatus="delivered",
                carrier="PostaRapida",
                trackingNumber="PR-55120987-IT",
                lastTrackingEvent="2025-11-03 Delivered to parcel locker.",
            ),
        ],
        notes="",
    ),
)

_BY_ID: dict[str, Customer] = {customer.customerId: customer for customer in _CUSTOMERS}


def find_customer(customer_id: str) -> Customer | None:
    return _BY_ID.get(customer_id.strip())


def all_customer_ids() -> list[str]:
    return list(_BY_ID)
